"""GPU benchmark: the full-size SDXL UNet per ZeRO stage, offload, resolution, micro batch and gradient
checkpointing; peak memory, speed, MFU, and our overhead over a hand-written DeepSpeed loop.

    python -m ds_trainer.bench --out benchmarks/h200                 # the target cells, then the rest
    python -m ds_trainer.bench --out benchmarks/h200 --cells targets --budget-min 9

Every cell is a real `python -m ds_trainer` run in a process of its own (model=sdxl_base: the real
architecture, random init, synthetic data, no logger). Its summary gives peak GPU memory allocated and
reserved (training steps only), median s/it and images/s after two warm-up steps, and the host RSS peak;
out of memory is a result (`oom`). MFU is the UNet's model FLOPs per image (forward and backward,
counted by torch's FlopCounterMode on the meta device: 20.2 TFLOP at 1024x1024, 4.7 at 512x512; the
recomputation of gradient checkpointing is not counted) times images/s, over the bf16 matrix rate
measured on the same GPU by this invocation. The raw loop runs the same DeepSpeed JSON and model through
`deepspeed.initialize` with tensors already on the GPU: the framework's s/it over the loop's is our
overhead. With `--overhead-pairs N` that cell and the raw loop run alternately N times and the overhead is
the median of the N ratios (each pair measured back to back, so a noisy machine's drift cancels).

Results are appended to `<out>/results.csv` as cells finish; a rerun skips the cells already there, so
a time-limited machine can continue the benchmark over several calls (`--budget-min`). `results.md`
holds the table and each target as measured; `cells/report.png` is the sweep report's chart.

Modules: `cli` (the flags, and which program they select), `matrix` (the cell matrix and the overhead pairs),
`results` (results.csv, the targets and results.md), `cells` (one cell, and the raw loop), `startup`
(`--startup-pairs`), `peer` (diffusers' script timed beside a run), `precision` (`--precisions`).
"""

from ds_trainer.tools.bench.cli import main

__all__ = ["main"]
