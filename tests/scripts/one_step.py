"""Run by `accelerate launch --config_file <run>/accelerate_config.yaml`: one training step.

Accelerator() is built with no arguments, so everything comes from the config file: this checks
that the file written by the dry run drives Accelerate (and DeepSpeed) on its own.
"""

import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler, InitProcessGroupKwargs

# Without CUDA, Accelerate leaves the process-group backend unset and then counts one process, and
# runs plain DDP over CPU only when asked for the CPU: ds_trainer's training does both, and so does this.
distributed_cpu = not torch.cuda.is_available() and "LOCAL_RANK" in os.environ
deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed_cpu else []
accelerator = Accelerator(cpu=distributed_cpu and not deepspeed, kwargs_handlers=handlers)
if fsdp and distributed_cpu:
    # Accelerate does not select FSDP for a CPU process; ds_trainer's training sets it as here (train/accel.py),
    # with the plugin Accelerate builds from the yaml's FSDP_* variables.
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()


class ResnetBlock2D(torch.nn.Sequential):  # the UNet's unit names the yaml lists, so the wrap policy finds them
    pass


class BasicTransformerBlock(torch.nn.Sequential):
    pass


model = torch.nn.Sequential(ResnetBlock2D(torch.nn.Linear(16, 256), torch.nn.ReLU()),
                            BasicTransformerBlock(torch.nn.Linear(256, 4)))
plugin = accelerator.state.deepspeed_plugin
if plugin is not None:
    ds = plugin.deepspeed_config
    optimizer = DummyOptim(model.parameters()) if "optimizer" in ds else torch.optim.AdamW(model.parameters())
    scheduler = DummyScheduler(optimizer) if "scheduler" in ds else None
else:
    optimizer, scheduler = torch.optim.AdamW(model.parameters(), lr=1e-3), None
if scheduler is None:
    model, optimizer = accelerator.prepare(model, optimizer)
else:
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
x = torch.randn(2, 16, device=accelerator.device)
with accelerator.autocast():
    loss = model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()
accelerator.backward(loss)
optimizer.step()
if scheduler is not None:
    scheduler.step()
optimizer.zero_grad()
result = {"rank": accelerator.process_index, "world": accelerator.num_processes,
          "distributed_type": str(accelerator.distributed_type), "mixed_precision": accelerator.mixed_precision,
          "zero_stage": plugin.zero_stage if plugin else None, "loss": loss.item()}
if accelerator.is_fsdp2:
    from torch.distributed.fsdp import FSDPModule

    fsdp_plugin = accelerator.state.fsdp_plugin
    result["fsdp"] = {"version": fsdp_plugin.fsdp_version, "reshard_after_forward": fsdp_plugin.reshard_after_forward,
                      "units": sum(isinstance(m, FSDPModule) for m in model.modules()) - 1}
Path(os.environ["ONE_STEP_OUT"], f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
accelerator.wait_for_everyone()
accelerator.end_training()
# Skip interpreter teardown: a C++ thread of the CPU collectives still joinable at exit aborts the
# process now and then ("terminate called without an active exception"); the result file is written.
os._exit(0)
