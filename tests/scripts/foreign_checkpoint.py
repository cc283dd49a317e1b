"""A checkpoint as diffusers' SDXL training script writes it under DeepSpeed: Accelerate's `save_state` of a
DeepSpeed engine around a diffusers UNet with the script's own torch.optim.AdamW (not ds_trainer's code).

Usage: python foreign_checkpoint.py OUT_DIR ZERO_STAGE STEPS
"""

import os
import socket
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from diffusers import UNet2DConditionModel

from ds_trainer import ASSETS_DIR

out, stage, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
      "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds),
                          kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
torch.manual_seed(0)
unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(ASSETS_DIR / "sdxl_tiny", subfolder="unet"))
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, weight_decay=1e-2)
unet, optimizer = accelerator.prepare(unet, optimizer)
c = accelerator.unwrap_model(unet).config
text_dim = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
for _ in range(steps):
    cond = {"text_embeds": torch.randn(1, text_dim), "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]])}
    pred = unet(torch.randn(1, 4, 16, 16), torch.tensor([500]), torch.randn(1, 77, c.cross_attention_dim),
                added_cond_kwargs=cond).sample
    accelerator.backward(pred.pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
accelerator.save_state(out)
accelerator.end_training()
