"""One optimizer step: its micro-batches (the model family's loss), backward, the optimizer and LR
step, EMA, the stop signal and the metrics. `TrainStep.__call__` is the body of the recipe's loop.

Noise and timesteps of a sample come from a generator seeded by (seed, the sample's position in the
run's sample sequence), and the data of a micro-batch is a function of its index, so a resumed run
repeats an uninterrupted one, also under another world size or micro batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ds_trainer.train.families import compiled
from ds_trainer.train.observe import metrics

if TYPE_CHECKING:
    from ds_trainer.train.data import Loader
    from ds_trainer.train.process.stop import StopRequest
    from ds_trainer.train.run import Run


@dataclass(frozen=True)
class Outcome:
    """What the ranks agreed on in the step's all-reduce: stop after it (a signal reached one of
    them), and save a checkpoint now (rank 0's wall-time interval has passed)."""

    stop: bool
    save: bool


class TrainStep:
    """Everything one step touches. Calling it trains step `step` and returns what the ranks agreed
    on."""

    def __init__(self, run: Run, loader: Loader, stop: StopRequest, progress: Any,
                 save_due: Callable[[], bool] = lambda: False) -> None:
        self.cfg, self.accelerator, self.backend, self.family = run.cfg, run.accelerator, run.backend, run.family
        self.model, self.optimizer, self.scheduler, self.ema = run.model, run.optimizer, run.scheduler, run.ema
        self.tracker, self.loader, self.stop, self.progress = run.tracker, loader, stop, progress
        self.save_due = save_due  # rank 0's clock decides for every rank
        self.noise_sched = self.family.schedule(self.cfg)  # SDXL's denoising, SD3's and Flux's flow matching
        self.device = self.accelerator.device
        self.dtype = self.backend.compute_dtype(self.model)
        self.accum = int(self.cfg.train.gradient_accumulation_steps)
        self.seed = int(self.cfg.train.seed)
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.images_per_step = int(self.cfg.train.micro_batch_size) * self.accum * run.mesh.data_world
        self.loss_scale = run.mesh.loss_scale  # parallel.context: a group's gradient parts sum, not average
        self.log_every, self.max_steps = int(self.cfg.train.log_every), int(self.cfg.train.max_steps)
        self.clip = float(self.cfg.train.gradient_clipping)
        # Reused every step: the stop and save flags travel with the loss in one all-reduce.
        self._flags = torch.zeros(2, device=self.device)
        # So do the sums and counts of the regularisation images' losses and the others'
        # (data.sources).
        self._parts = torch.zeros(4, device=self.device)
        self._norm: Any = None  # measured where the backend clips before its optimizer step

    def __call__(self, step: int) -> Outcome:
        start, data_wait, compiling = time.perf_counter(), 0.0, compiled.seconds()
        logging = step % self.log_every == 0 or step == self.max_steps
        loss_sum = None
        self._parts.zero_()
        for m in range(self.accum):
            b = (step - 1) * self.accum + m
            fetch = time.perf_counter()
            batch = self.loader(b)
            data_wait += time.perf_counter() - fetch
            loss = self._micro_step(batch, logging)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        grad_norm = self.backend.grad_norm(self.accelerator, self._norm) if logging else None
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.accelerator.unwrap_model(self.model))
        # One all-reduce (and one host sync) per step carries the loss, whether any rank must stop,
        # and whether rank 0 says a checkpoint is due.
        assert loss_sum is not None
        self._flags[0] = float(self.stop.requested)
        self._flags[1] = float(self.rank == 0 and self.save_due())
        self.stop.announce(self.progress)
        values = torch.cat([(loss_sum.detach().float() / self.accum).reshape(1), self._flags, self._parts])
        mean_loss, stopping, due, *parts = self.accelerator.reduce(values, reduction="mean").tolist()
        compiling = compiled.seconds() - compiling  # train.compile: reported apart, not in s/it
        elapsed = time.perf_counter() - start - compiling
        if logging:
            self._log(step, mean_loss, grad_norm, elapsed, data_wait, parts, compiling)
        if self.progress is not None:
            self.progress.update(1)
        return Outcome(stop=stopping > 0, save=due > 0)

    def _micro_step(self, batch: dict[str, torch.Tensor], logging: bool) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(self.seed * 1_000_003 + int(i)) for i in batch["position"]]
        with self.accelerator.accumulate(self.model), self.accelerator.autocast():
            losses = self.family.training_loss(self.cfg, self.model, self.noise_sched, batch, gens, self.device,
                                               self.dtype)
            loss = losses.mean()
            self.accelerator.backward(loss * self.loss_scale if self.loss_scale != 1 else loss)
            if self.accelerator.sync_gradients and (self.clip > 0 or logging):
                # The backend clips here or inside its optimizer step (DeepSpeed); an infinite limit
                # only measures.
                limit = self.clip if self.clip > 0 else float("inf")
                self._norm = self.backend.clip(self.accelerator, self.model, limit)
            self.optimizer.step()
            self.optimizer.zero_grad()
        if "regularization" in batch:
            self._parts += _parts(losses.detach().float(), batch)
        return loss

    def _log(self, step: int, mean_loss: float, grad_norm: float | None, elapsed: float, data_wait: float,
             parts: list[float], compiling: float) -> None:
        values: dict[str, Any] = {"loss": mean_loss, "lr": learning_rate(self.optimizer, self.scheduler),
                                  **({"loss_regularization": parts[0] / parts[1]} if parts[1] else {}),
                                  **({"loss_images": parts[2] / parts[3]} if parts[1] and parts[3] else {}),
                                  **({"lr_text_encoders": learning_rate(self.optimizer, self.scheduler, group=1)}
                                     if len(self.optimizer.param_groups) > 1 else {}),
                                  "s_per_it": elapsed, "data_wait_s": data_wait,
                                  "images_per_s": self.images_per_step / elapsed,
                                  "host_rss_peak_mib": metrics.host_rss_peak_mib(), **metrics.gpu_memory(self.device)}
        if grad_norm is not None:
            values["grad_norm"] = grad_norm
        if compiling:
            values["compile_s"] = compiling
        self.tracker.log(step, values)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{mean_loss:.4f}", s_it=f"{elapsed:.2f}", mem=_mem_text(values),
                                      **self.tracker.postfix, refresh=False)


def _parts(losses: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[sum, count] of the regularisation images' losses, then of the others', each before its
    source's loss_weight (what a sample's loss is, whatever weighs it in training)."""
    weight = batch["loss_weight"].to(losses.device, losses.dtype)
    raw = torch.where(weight > 0, losses / weight.clamp_min(1e-12), torch.zeros_like(losses))
    reg = batch["regularization"].to(losses.device)
    return torch.stack([raw[reg].sum(), reg.sum(), raw[~reg].sum(), (~reg).sum()]).float()


def learning_rate(optimizer: Any, scheduler: Any, group: int = 0) -> float:
    """The LR of parameter group `group` (0: the UNet's; 1: the trained text encoders')."""
    if scheduler is not None and hasattr(scheduler, "get_last_lr"):
        try:
            return float(scheduler.get_last_lr()[group])
        except (AttributeError, IndexError, TypeError):
            pass
    return float(optimizer.param_groups[group]["lr"])


def _mem_text(values: dict[str, Any]) -> str:
    if "gpu_mem_peak_allocated_mib" in values:
        return f"{values['gpu_mem_peak_allocated_mib'] / 1024:.1f}G"
    return f"rss {values['host_rss_peak_mib'] / 1024:.1f}G"
