"""The memory planner: before a run, which ZeRO stage and offload fit, per rank, and why.

    python -m ds_trainer.plan resolution=px1024 train.micro_batch_size=8 [plan.vram_gib=24]

Takes the same overrides as training. For every zero x offload cell it estimates the peak GPU memory
per rank (torch's allocated bytes: parameters, gradients, optimizer state, activations, DeepSpeed's
buffers), host RAM and NVMe bytes, marks what fits `plan.vram_gib` (default: the detected GPU) and
recommends the cheapest cell that fits (each higher stage or offload costs speed).

Method, per part (bytes; P = UNet parameters, N = ranks, L = largest layer's parameters):
- model states: DeepSpeed's own accounting, split into parts whose sums equal
  `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` (a test checks):
  stage 0-2 no offload 2P + 18P/N (stage 1 keeps full 16-bit gradients: + 2P - 2P/N), stage 1-2 with
  offload 2P, stage 3 4L + 18P/N, 4L + 2P/N (optimizer offloaded), 4L (parameters offloaded too);
  DDP keeps fp32 weights, gradients and AdamW state: 16P. fp32 precision doubles the 16-bit parts.
- activations: counted, not guessed: the UNet runs forward on the meta device (no memory, no
  download) under autograd's saved-tensor hooks, which see every tensor kept for backward. Attention
  is counted as memory-efficient kernels store it (q, k, v, output, log-sum-exp), not as the full
  attention matrix, unless `train.attention=math`, whose kernel saves it. With gradient
  checkpointing: what is saved across checkpointed blocks plus the largest block's own activations,
  recomputed one at a time in backward.
- DeepSpeed buffers: stage 1-2 reduce + allgather buckets (x4.5 with overlap_comm, DeepSpeed's rule of
  thumb), stage 3 prefetch + reduce buckets, in 16-bit elements.
- host RAM: offloaded optimizer state (DeepSpeed's estimate, x1.5 buffer factor) and pinned NVMe swap
  buffers; NVMe bytes: the ZeRO-3 swap estimate of `nvme.swap_bytes`.

Modules: `cells` (the estimate of each zero x offload cell), `states` (model states per rank and checkpoint
bytes), `unet` (the trained module on the meta device: parameters, activations), `lora` (a module part frozen,
part trained: adapters, trained text encoders), `samples` (the peak while sampling or validating), `calibration`
(the correction learned from measured cells), `cache` (the slow parts remembered on disk), `advice` (the table,
the recommendation, the training log's lines), `cli` (`python -m ds_trainer.plan`), `table` (the README's table).
"""

from ds_trainer.tools.plan.advice import describe, log_for_run, recommend
from ds_trainer.tools.plan.cells import CELLS, FSDP_CELLS, GIB, Estimate, activation_bytes, estimate, plan
from ds_trainer.tools.plan.cli import main
from ds_trainer.tools.plan.states import architecture, checkpoint_bytes, model_states
from ds_trainer.tools.plan.unet import UNetStats, unet_inputs, unet_stats

__all__ = ["CELLS", "FSDP_CELLS", "GIB", "Estimate", "UNetStats", "activation_bytes", "architecture",
           "checkpoint_bytes", "describe", "estimate", "log_for_run", "main", "model_states", "plan", "recommend",
           "unet_inputs", "unet_stats"]
