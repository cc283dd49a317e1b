"""DeepSpeed ZeRO 0-3 (with CPU or NVMe offload) through Accelerate's DeepSpeedPlugin.

DeepSpeed builds the optimizer and LR schedule its JSON defines (DummyOptim/DummyScheduler stand in for them), or
takes a client optimizer ds_trainer builds; it clips inside its step, keeps the fp32 masters apart from the
module's 16-bit parameters, and saves its own checkpoint (frozen parameters left out with
`exclude_frozen_parameters`). Where its load leaves something out, `masters.restore_optimizer_clocks` puts it back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.errors import TrainingError
from ds_trainer.train.backends import accelerator as accel
from ds_trainer.train.backends import inner, masters, nvme_swap
from ds_trainer.train.backends.params import Whole, Zero

log = logging.getLogger("ds_trainer")


@dataclass
class DeepSpeed:
    """The DeepSpeed backend of a run whose JSON is `ds`."""

    cfg: DictConfig
    ds: dict[str, Any]
    name: str = field(default="deepspeed", init=False)
    init_label: str = field(default="DeepSpeed init", init=False)
    fused: bool = field(default=True, init=False)
    host_collectives: bool = field(default=False, init=False)

    def start_process(self) -> None:
        from ds_trainer.config import op_cache

        op_cache.prepare()  # this environment's compiled ops (never another venv's), no CPU probes per op load

    def accelerator_kwargs(self, platform_kind: str) -> tuple[dict[str, Any], list[Any]]:  # noqa: ARG002
        return {"deepspeed_plugin": plugin(self.ds)}, []

    def after_accelerator(self, accelerator: Any, platform_kind: str) -> None:
        pass

    def whole(self, accelerator: Any) -> contextlib.AbstractContextManager[None]:
        return outside_zero3(accelerator.state.deepspeed_plugin)

    def before_build(self, accelerator: Any) -> None:
        _prepare_nvme(self.cfg, accelerator)

    def own_optimizer(self, params: list[Any]) -> tuple[Any, Any] | None:
        if "optimizer" not in self.ds:  # a client optimizer (torch's AdamW, bitsandbytes', Prodigy, ...)
            return None
        from accelerate.utils import DummyOptim, DummyScheduler

        optimizer = DummyOptim(params, lr=self.ds["optimizer"]["params"]["lr"])
        return optimizer, DummyScheduler(optimizer) if "scheduler" in self.ds else None

    def before_prepare(self, model: Any) -> None:
        pass

    def prepare(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
        if "nvme" in (self.cfg.resolved.optimizer_state_on, self.cfg.resolved.params_on):
            _check_swap_space(self.cfg, accelerator)
        return accel.prepare(accelerator, model, optimizer, scheduler)

    def masters_from_cast(self, resuming: bool) -> bool:
        return not resuming and str(self.cfg.precision.name.value) in ("bf16", "fp16")

    def compute_dtype(self, model: Any) -> Any:
        # The engine's 16-bit (or fp32) parameters; a quantized base's packed integer weights are not what it computes
        # in (quantize=nf4|int8: Flux's and Qwen-Image's first layer is a quantized linear one)
        return next(p.dtype for p in model.parameters() if p.is_floating_point())

    def clip(self, accelerator: Any, model: Any, limit: float) -> Any:  # noqa: ARG002
        return None  # DeepSpeed clips inside its step (gradient_clipping in its JSON)

    def grad_norm(self, accelerator: Any, measured: Any) -> float | None:  # noqa: ARG002
        norm = inner.engine(accelerator).get_global_grad_norm()
        return float(norm) if norm is not None else None

    def owns_schedule(self, accelerator: Any) -> bool:
        # The schedule handed to `prepare` (its JSON's or ours); per-group schedules come after it, and are ours.
        return inner.engine(accelerator).lr_scheduler is not None

    def engine(self, accelerator: Any) -> Any:
        return inner.engine(accelerator)

    def params(self, accelerator: Any) -> Whole:
        return Zero(partial(inner.engine, accelerator), int(self.ds["zero_optimization"]["stage"]))

    def keep_trainable_only(self, accelerator: Any) -> dict[str, Any]:  # noqa: ARG002
        return {"exclude_frozen_parameters": True}

    def load(self, accelerator: Any, path: Path, partial: bool) -> None:
        accelerator.load_state(str(path), **({"load_module_strict": False} if partial else {}))
        masters.restore_optimizer_clocks(inner.engine(accelerator))


def plugin(ds: dict[str, Any]) -> Any:
    """A DeepSpeedPlugin for `ds` with every field explicit (nothing read from the environment)."""
    from accelerate.utils import DeepSpeedPlugin

    zero = ds["zero_optimization"]
    offload_optimizer = zero.get("offload_optimizer", {})
    offload_param = zero.get("offload_param", {})
    return DeepSpeedPlugin(
        hf_ds_config=ds,
        gradient_accumulation_steps=ds["gradient_accumulation_steps"],
        gradient_clipping=ds["gradient_clipping"],
        zero_stage=zero["stage"],
        is_train_batch_min=True,
        offload_optimizer_device=offload_optimizer.get("device", "none"),
        offload_param_device=offload_param.get("device", "none"),
        offload_optimizer_nvme_path=offload_optimizer.get("nvme_path", "none"),
        offload_param_nvme_path=offload_param.get("nvme_path", "none"),
        zero3_init_flag=zero["stage"] == 3,
        zero3_save_16bit_model=bool(zero.get("stage3_gather_16bit_weights_on_model_save", False)),
        # None, not "": Accelerate would look for a layer class named "" (a UNet has no MoE layers).
        transformer_moe_cls_names=None,
        enable_msamp=False,
        msamp_opt_level="O1",
    )


@contextlib.contextmanager
def outside_zero3(deepspeed_plugin: Any) -> Iterator[None]:
    """Build frozen models whole: loaded while a ZeRO-3 config is live, transformers would partition
    them with zero.Init and their forward would fail on shapes (diffusers#1865). A no-op without ZeRO-3."""
    if deepspeed_plugin is None or deepspeed_plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    with deepspeed_plugin.zero3_init_context_manager(enable=False):
        unset_hf_deepspeed_config()
        yield


def _prepare_nvme(cfg: DictConfig, accelerator: Any) -> None:
    """Before DeepSpeed starts: the async_io op must load, and stale swap from earlier runs must go."""
    if "nvme" not in (cfg.resolved.optimizer_state_on, cfg.resolved.params_on):
        return
    import torch

    from ds_trainer.config import nvme

    if cfg.resolved.optimizer_state_on == "nvme":
        nvme_swap.align_gradient_reads()  # DeepSpeed's swapped-gradient read misses unaligned slices
    if accelerator.local_process_index == 0:
        error = nvme.aio_load_error(gpu=torch.cuda.is_available())
        if error:
            raise TrainingError(f"offload=nvme: {error}")
        for stale in nvme.remove_stale_swap(cfg.offload.nvme_path):
            log.warning("removed stale NVMe swap folder %s (left by an earlier run; it breaks resumes)", stale)
    accelerator.wait_for_everyone()


def _check_swap_space(cfg: DictConfig, accelerator: Any) -> None:
    """Right before DeepSpeed writes its NVMe swap, check the room again: the disk may have filled up since
    the configuration was checked, and DeepSpeed does not notice a full swap disk (the files end short
    and it aborts the process on reading one back: no message, no summary)."""
    from ds_trainer.config.checks import resolve

    why = resolve.swap_problem(cfg) if accelerator.local_process_index == 0 else None
    if accel.any_rank(accelerator, why is not None):
        raise TrainingError(f"offload.nvme_path={cfg.offload.nvme_path} {why or 'is full on another node'}: the disk "
                            "filled up after the configuration was checked; nothing was trained and no checkpoint "
                            "was touched. Free space there or set offload.nvme_path to a larger disk, then run "
                            "again (resume=latest continues)")
