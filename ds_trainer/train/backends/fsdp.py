"""FSDP2 (`zero=fsdp_full_shard|fsdp_shard_grad_op`) through Accelerate's FullyShardedDataParallelPlugin.

The parameters, gradients and optimizer state are DTensors sharded over the ranks (`sharded.py` reads and writes
whole values of them); the optimizer is torch's (not fused: the fused kernels take no DTensors), built by
optim/build.py from the same blocks as DeepSpeed's, and its LR schedule one of DeepSpeed's classes that the recipe
registers for checkpoints. Checkpoints are torch.distributed.checkpoint's sharded state dict, resharded on load.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.train.backends import accelerator as accel
from ds_trainer.train.backends import ddp
from ds_trainer.train.backends.params import Sharded, Whole


@dataclass
class FSDP:
    """The FSDP2 backend of a run."""

    cfg: DictConfig
    name: str = field(default="fsdp", init=False)
    fused: bool = field(default=False, init=False)
    init_label: str = field(default="FSDP init", init=False)
    host_collectives: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._plugin: Any = None
        # CPU offload: the shards, their gradients and Adam's state live on the host; clipping's norm and the
        # portable state's gathers reduce them there
        self.host_collectives = self.cfg.offload.device.value == "cpu"

    def start_process(self) -> None:
        from ds_trainer.config import op_cache

        op_cache.use_environment_folder()  # FSDP loads no DeepSpeed op: importing DeepSpeed would only cost start-up

    def accelerator_kwargs(self, platform_kind: str) -> tuple[dict[str, Any], list[Any]]:
        from accelerate.utils import GradientAccumulationPlugin

        self._plugin = plugin(self.cfg, platform_kind)
        # Gradients reduce-scattered after every micro-batch: no full unsharded gradient kept between them
        # (Accelerate's no_sync would keep one per rank, the whole UNet's in the reduce dtype).
        kwargs: dict[str, Any] = {"gradient_accumulation_plugin": GradientAccumulationPlugin(
            num_steps=int(self.cfg.train.gradient_accumulation_steps), sync_each_batch=True)}
        if platform_kind == "cpu":
            kwargs["cpu"] = True
        else:
            kwargs["fsdp_plugin"] = self._plugin
        return kwargs, []

    def after_accelerator(self, accelerator: Any, platform_kind: str) -> None:
        from ds_trainer.errors import TrainingError

        if platform_kind == "cpu":
            _fsdp_on_cpu(accelerator, self._plugin)
        if not accelerator.is_fsdp2:
            raise TrainingError(f"zero={self.cfg.zero.backend.value}: Accelerate set up {accelerator.distributed_type} "
                                "instead of FSDP2; check the accelerate version (pip install -c constraints.txt "
                                "accelerate) and unset ACCELERATE_* variables")

    def whole(self, accelerator: Any) -> contextlib.AbstractContextManager[None]:  # noqa: ARG002
        return contextlib.nullcontext()

    def before_build(self, accelerator: Any) -> None:
        pass

    def own_optimizer(self, params: list[Any]) -> tuple[Any, Any] | None:  # noqa: ARG002
        return None

    def before_prepare(self, model: Any) -> None:
        if self.cfg.precision.name.value == "bf16_pure":
            import torch

            model.to(torch.bfloat16)  # FSDP2 shards the parameters as they are: bf16 masters, gradients, Adam state
        if self.cfg.train.compile.value != "none":
            import torch._functorch.config as aot

            # Measured (torch 2.13 on CPU, 1 and 2 ranks): under FSDP2 in bf16_pure, SD3's
            # joint attention with a LoHa or LoKr adapter compiled around its graph breaks,
            # and AOTAutograd's view replay of an output aliasing another tensor rebuilt it
            # with garbage sizes at the first step ("invalid shape dimension -30385853...").
            # Its as_strided regeneration, torch's path before view replay, rebuilds the same
            # view: the run trains.
            aot.view_replay_for_aliased_outputs = False

    def prepare(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
        return accel.prepare(accelerator, model, optimizer, scheduler)

    def masters_from_cast(self, resuming: bool) -> bool:  # noqa: ARG002
        return False  # the sharded fp32 parameters are the masters

    def compute_dtype(self, model: Any) -> Any:  # noqa: ARG002
        import torch

        return torch.float32  # the mixed-precision policy casts in the forward

    def clip(self, accelerator: Any, model: Any, limit: float) -> Any:
        return accelerator.clip_grad_norm_(model.parameters(), limit)

    def grad_norm(self, accelerator: Any, measured: Any) -> float | None:  # noqa: ARG002
        return float(measured) if measured is not None else None

    def owns_schedule(self, accelerator: Any) -> bool:  # noqa: ARG002
        return False

    def engine(self, accelerator: Any) -> Any:  # noqa: ARG002
        return None

    def params(self, accelerator: Any) -> Whole:  # noqa: ARG002
        return Sharded()

    def keep_trainable_only(self, accelerator: Any) -> dict[str, Any]:
        ddp.register_keep_trainable(accelerator)
        return {}

    def load(self, accelerator: Any, path: Path, partial: bool) -> None:
        accelerator.load_state(str(path), **({"strict": False} if partial else {}))


def plugin(cfg: DictConfig, platform_kind: str) -> Any:
    """A FullyShardedDataParallelPlugin (FSDP2) with every field explicit: a field left None is read from the
    `FSDP_*` environment, and one set that FSDP2 does not use warns or raises."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    meaning = cfg.resolved.fsdp
    compute = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}.get(meaning.compute_dtype, "float32"))
    reduce = getattr(torch, {"bf16": "bfloat16"}.get(meaning.reduce_dtype, "float32"))
    # Pinned host memory needs an accelerator; a CPU-only build fails with "Cannot access accelerator device".
    offload = CPUOffloadPolicy(pin_memory=platform_kind != "cpu" and bool(cfg.offload.pin_memory)) \
        if cfg.offload.device.value == "cpu" else OffloadPolicy()
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=bool(meaning.reshard_after_forward),
        # The compute dtype of the forward and backward; the sharded fp32 parameters stay the masters.
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, output_dtype=compute,
                                                    cast_forward_inputs=True),
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(meaning.units),
        cpu_offload=offload,
        ignored_modules=[],
        state_dict_type="SHARDED_STATE_DICT",  # torch.distributed.checkpoint: reshards on load, any world size
        activation_checkpointing=False,  # the UNet's own gradient checkpointing (it keeps parameter names)
        activation_checkpointing_offload=False,
        cpu_ram_efficient_loading=False,
        min_num_params=0,
    )


def _fsdp_on_cpu(accelerator: Any, fsdp_plugin: Any) -> None:
    """Accelerate never selects FSDP for a CPU process (it gives DDP, silently); FSDP2 itself runs on gloo. Set
    the distributed type in both places Accelerate reads it (else a later AcceleratorState() reverts it), as
    Accelerate 1.14-1.15 keep them; `after_accelerator` then checks that FSDP2 is what runs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = fsdp_plugin
