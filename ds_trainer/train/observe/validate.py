"""The validation loss: one number per evaluation that depends on the weights alone, not on the
layout.

It is the mean denoising loss over every (image, timestep) pair of the validation set
(config/holdout.py says which images and timesteps): the noise of a pair comes from a generator
seeded by `validation.seed`, the image's number and the timestep's, the error is the plain mean
squared error against the prediction target (no min-SNR weighting, no noise offset, so runs that
differ in those still compare), and the sum is taken in float64. The pairs are dealt round robin
over the ranks and the sums all-reduced: with the same weights the value is the same under DDP,
ZeRO-0..3 and FSDP on any number of ranks, with any micro batch or accumulation, up to the order
floating-point sums are taken in. On one layout it is exact: two evaluations of the same weights
agree.

Under ZeRO-3 and FSDP every forward gathers the parameters from all ranks, so every rank makes the
same number of forward calls (a rank with fewer pairs repeats one and drops its result). The
evaluation is collective and runs at steps that depend on the step alone (`holdout.due`); its time
is measured apart from s/it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import holdout
from ds_trainer.train import data
from ds_trainer.train.families import text_encoders
from ds_trainer.train.observe.sampling import ema_model, plain_linear

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")

Item = dict[str, torch.Tensor]


class ValidationSet:
    """This rank's share of the (image, timestep) pairs and the cached tensors of their images, made
    once at the start (while the frozen encoders are on the device). `build_cache` builds a latent
    cache collectively (the recipe's, so the validation images are encoded once across runs, like
    the training ones)."""

    def __init__(self, run: Run, build_cache: Callable[[Any], data.LatentCache | None]) -> None:
        cfg, accelerator, frozen = run.cfg, run.accelerator, run.frozen
        self.cfg = cfg
        images = data.validation_set(cfg, accelerator)
        self.names = images.names()
        self.family = run.family
        self.noise_sched = self.family.schedule(cfg)
        self.timesteps = holdout.timesteps(cfg, self.family.num_train_timesteps(self.noise_sched))
        pairs = [(i, j) for i in range(len(images)) for j in range(len(self.timesteps))]
        # A context group scores its pairs together (each pair's sum and count then come once from
        # each of its ranks: the mean is the same)
        rank, world = run.mesh.data_rank, run.mesh.data_world
        self.mine = pairs[rank::world]
        self.total = len(pairs)
        cache = build_cache(images)
        wanted = sorted({i for i, _ in self.mine} | {0})  # image 0: the padding forward of a rank without pairs
        self.items: dict[int, Item] = {}
        for index in wanted:  # one by one: with buckets the images differ in shape
            loaded = cache.load([index]) if cache is not None else \
                data.encode_batch(images, frozen, [index], accelerator.device, self.family)
            self.items[index] = {key: value[0] for key, value in loaded.items()}
        batch = int(cfg.validation.batch_size) or int(cfg.train.micro_batch_size)
        # Forwards of one shape (a bucket) each, in a fixed order: the same sums on every
        # evaluation.
        by_shape: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for i, j in self.mine:
            by_shape.setdefault(tuple(self.items[i]["latents"].shape), []).append((i, j))
        self.chunks = [group[k:k + batch] for _, group in sorted(by_shape.items()) for k in range(0, len(group), batch)]
        counts = torch.tensor([len(self.chunks)], device=accelerator.device)
        if world > 1:
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
        self.calls = int(counts.item())
        self.description = {"images": len(images), "timesteps": self.timesteps, "pairs": self.total,
                            "source": _source(cfg), "seed": int(cfg.validation.seed)}

    def batch(self, chunk: list[tuple[int, int]]) -> tuple[Item, torch.Tensor, torch.Tensor]:
        """The stacked tensors of a forward's pairs, their noise (fixed per pair) and their
        timesteps."""
        seed = int(self.cfg.validation.seed)
        stacked = {key: torch.stack([self.items[i][key] for i, _ in chunk]) for key in self.items[chunk[0][0]]}
        noise = torch.stack([torch.randn(self.items[i]["latents"].shape,
                                         generator=torch.Generator().manual_seed(seed * 1_000_003 + i * 1_009 + j))
                             for i, j in chunk])
        t = torch.tensor([self.timesteps[j] for _, j in chunk], dtype=torch.long)
        return stacked, noise, t

    def write(self, run_dir: Path) -> None:
        """Rank 0: which images and timesteps the run scores (`validation_set.json`)."""
        (run_dir / "validation_set.json").write_text(json.dumps({**self.description, "names": self.names}, indent=1))


def _source(cfg: DictConfig) -> str:
    if cfg.validation.path is not None:
        return f"validation.path={cfg.validation.path}"
    if cfg.data.source.value == "synthetic":
        return "synthetic images after the training ones"
    if cfg.data.source.value == "sources":
        from ds_trainer.train.data import sources

        names = ", ".join(source.name for source in sources.of(cfg))
        return f"held out of data.sources ({names}) (validation.split={cfg.validation.split})"
    return f"held out of data.path={cfg.data.path} (validation.split={cfg.validation.split})"


class Validator:
    """Scores the weights at the steps `holdout.due` names. Collective: every rank calls
    `after_step`."""

    def __init__(self, run: Run, vset: ValidationSet, dtype: torch.dtype) -> None:
        cfg = run.cfg
        self.cfg, self.accelerator, self.model, self.vset = cfg, run.accelerator, run.model, vset
        self.tracker, self.dtype, self.weights = run.tracker, dtype, run.eval_weights
        self.ema = run.ema if cfg.validation.ema else None
        # The EMA put into the live module (a LoRA's adapters on its frozen base; the UNet and text
        # encoders trained together), rather than a float32 UNet built on it.
        self.in_place = cfg.adapter.method.value != "none" or text_encoders.enabled(cfg)

    def after_step(self, step: int, stopping: bool = False) -> None:
        """Validate if `step` is due (every rank decides the same); not when a stop request cut the
        run short."""
        if not holdout.due(self.cfg, step) or (stopping and step < int(self.cfg.train.max_steps)):
            return
        start = time.perf_counter()
        with self.weights():
            values = {"val_loss": self.score(self.accelerator.unwrap_model(self.model), self.dtype)}
        if self.ema is not None and self.in_place:
            module = self.accelerator.unwrap_model(self.model)
            with self.ema.applied(module):
                values["val_loss_ema"] = self.score(module, self.dtype)
        elif self.ema is not None:  # a float32 UNet on the EMA shadow, as samples and the export use
            model = ema_model(self.accelerator, self.model, self.ema, "validation.ema")
            values["val_loss_ema"] = self.score(model, torch.float32)
            del model
        values["val_s"] = time.perf_counter() - start
        self.tracker.log_validation(step, values)
        if self.accelerator.is_main_process:
            ema_text = f", EMA {values['val_loss_ema']:.6f}" if "val_loss_ema" in values else ""
            log.info("validation loss %.6f%s at step %d (%d pairs, %.1fs)", values["val_loss"], ema_text, step,
                     self.vset.total, values["val_s"])

    def score(self, model: Any, dtype: torch.dtype) -> float:
        """The mean loss of every pair with `model`'s weights (collective)."""
        device = self.accelerator.device
        totals = torch.zeros(2, dtype=torch.float64)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), plain_linear(), self.accelerator.autocast():
                for k in range(self.vset.calls):
                    real = k < len(self.vset.chunks)
                    chunk = self.vset.chunks[k] if real else [(0, 0)]
                    batch, noise, t = self.vset.batch(chunk)
                    losses = self.vset.family.losses(model, self.vset.noise_sched, batch, noise, t, device, dtype)
                    if real:
                        totals += torch.tensor([losses.double().sum().item(), len(chunk)], dtype=torch.float64)
        finally:
            model.train(was_training)
        if self.accelerator.num_processes > 1:
            totals = totals.to(device)
            torch.distributed.all_reduce(totals)
        loss_sum, n = totals.tolist()
        return loss_sum / n
