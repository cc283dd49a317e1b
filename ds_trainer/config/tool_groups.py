"""The schemas of the tools' own groups (`plan`, `tune`), torch-free; config/schema.py composes
them into the config."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass
class PlanConfig:
    """`python -m ds_trainer.plan`: the VRAM budget per GPU (None: the detected GPU's memory minus
    `margin`)."""

    vram_gib: float | None = None
    # Of a detected GPU's memory, kept for the CUDA context, fragmentation and what the allocator
    # reserves.
    margin: float = 0.1
    # Measured cells (written by `python -m ds_trainer.tune`) the planner corrects its activations
    # from.
    calibration: str = "${paths.outputs}/plan_calibration.jsonl"


class Objective(str, Enum):
    speed = "speed"  # the fastest configuration that fits: images/s of short cells
    quality = "quality"  # the lowest validation loss in a budget: a search with early stopping


class Sampler(str, Enum):
    tpe = "tpe"  # Optuna's tree-structured Parzen estimator (random for its first trials)
    random = "random"
    grid = "grid"  # every combination of the axes' choices (no interval), each once


class Pruner(str, Enum):
    halving = "halving"  # successive halving: at each rung the best 1/tune.reduction go on
    hyperband = "hyperband"  # several halving brackets of different first rungs
    median = "median"  # stop a trial worse than the median of the others at its rung
    none = "none"  # every trial to its end (a grid's reference)


@dataclass
class TuneConfig:
    """`python -m ds_trainer.tune`: the search space and how each cell is measured (see
    tools/tune/)."""

    # GiB per GPU; None: the detected GPU's memory minus `margin` (no GPU: nothing is pruned).
    vram_gib: float | None = None
    margin: float = 0.1
    # Images per optimizer step (accumulation derived per micro batch); None: free (train's
    # accumulation).
    global_batch: int | None = None
    zero: list[str] = field(default_factory=lambda: ["stage0", "stage1", "stage2", "stage3"])
    offload: list[str] = field(default_factory=lambda: ["none", "cpu"])
    micro_batch_size: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    gradient_checkpointing: list[bool] = field(default_factory=lambda: [False, True])
    # Optimizers to search too (e.g. [adamw,adamw8bit]: 8-bit moments may let a larger micro batch
    # or a lower ZeRO stage fit); empty: the training's optimizer only.
    optimizer: list[str] = field(default_factory=list)
    # Adapters and quantized bases to search too (e.g. adapter=[lora,lokr] quantize=[none,nf4]: a
    # LoKr's smaller state or an NF4 base may let a lower ZeRO stage or a larger micro batch fit);
    # empty: the training's own.
    adapter: list[str] = field(default_factory=list)
    quantize: list[str] = field(default_factory=list)
    # train.compile to search too (e.g. [none,blocks]): a cell's s/it leaves its compile time out
    # (measured apart, the compile_s column), and the winner says whether compiling pays.
    compile: list[str] = field(default_factory=list)
    # parallel.context to search too (e.g. [1,2,4]): a sequence split over more ranks keeps less of
    # its activations on each, so a larger micro batch or no checkpointing may fit; the global
    # batch counts the data groups (world size / context).
    context: list[int] = field(default_factory=list)
    warmup_steps: int = 2
    timed_steps: int = 5
    # Seconds per cell, start-up included: a cell still running then is stopped and counts as a
    # hang.
    time_limit_s: float = 900.0
    # None: each cell a local process; else a hydra/launcher option (local_2proc, slurm_gpu, ...).
    launcher: str | None = None
    # The tune folder (re-running the same command continues there) and the experiment preset's
    # name.
    name: str = "tuned"
    dir: str = "${paths.outputs}/tune/${tune.name}"
    # A config folder: the preset goes to <preset_dir>/experiment/<name>.yaml. None:
    # <paths.outputs>/presets (found by `+experiment=<name>` as is, with the same paths.outputs);
    # another folder needs `hydra.searchpath=[file://<folder>]`.
    preset_dir: str | None = None
    # speed: the fastest cell that fits (the axes above). quality: the lowest validation loss in
    # tune.budget, over the axes given as sweeps on the command line ('optimizer.lr=tag(log,
    # interval(1e-5,1e-3))' adapter.rank=4,8,16 optimizer=adamw,adamw8bit); docs/tuner.md.
    objective: Objective = Objective.speed
    # quality: when the search stops: device time (8h, 90m, 600s: each trial's seconds x its ranks)
    # or optimizer steps of all trials (4000steps); None: tune.trials alone (or the whole grid).
    budget: str | None = None
    # quality: at most this many trials (those the checks or the planner refuse not counted).
    trials: int | None = None
    # quality: trials run side by side, each through tune.launcher; more workers join a study by
    # running the same command (its storage on a shared disk).
    workers: int = 1
    sampler: Sampler = Sampler.tpe
    pruner: Pruner = Pruner.halving
    # quality: the pruner's rungs are a trial's steps / this**k (k = rungs .. 1); at each the best
    # 1/reduction of the trials go on.
    reduction: int = 3
    # quality: the rungs before a trial's end; the first at train.max_steps / reduction**rungs
    # (down to a multiple of validation.every). 1: judged once, at a third of the run: a high
    # learning rate's first steps overshoot, and a rung in them prunes the rate that ends best.
    rungs: int = 1
    # quality: TPE's trials drawn at random before it models the losses; None: a third of the
    # full trials the budget affords (at least 2), at most 3 an axis and 10.
    startup: int | None = None
    # quality: the sampler's seed (each trial's training seeds are train.seed, recorded).
    seed: int = 0
    # quality: the study's storage: None: a journal file in tune.dir (Optuna's JournalFileBackend,
    # safe on NFS); else an Optuna RDB URL (sqlite:///study.db, postgresql://...).
    storage: str | None = None
    # quality: seconds per trial, start-up included (None: no limit); a trial still running then
    # is stopped and fails.
    trial_limit_s: float | None = None
    # quality: how often a worker says its trial lives; a trial silent for 4x this (its worker
    # killed, its node lost) is failed by the other workers and run again once.
    heartbeat_s: float = 30.0
    # quality: train the chosen trial once more from scratch, its loss beside the search's.
    rerun: bool = True
