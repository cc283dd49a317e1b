"""The schemas of the tools' own groups (`plan`, `tune`), torch-free; config/schema.py composes
them into the config."""

from __future__ import annotations

from dataclasses import dataclass, field


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
