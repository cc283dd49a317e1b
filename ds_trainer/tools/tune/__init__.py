"""The fastest configuration that fits, measured: `python -m ds_trainer.tune [training overrides] [tune.*]`.

1. The space: tune.zero x tune.offload x tune.micro_batch_size x tune.gradient_checkpointing (x tune.optimizer,
   tune.adapter, tune.quantize and tune.compile when given), the
   accumulation derived from tune.global_batch (images per optimizer step) or, when that is null, the
   training's own. An axis set on the command line (e.g. `zero=stage3`) is held at that value.
2. Cells the configuration check rejects are dropped (`invalid`); the planner (tools/plan/, calibrated
   by earlier tunes) drops those it predicts above the budget (`pruned`) before anything runs.
3. The rest run one at a time, likely winners first (lower ZeRO ladder rung, no checkpointing, larger
   micro batch), each a short real training (cell.py) under a hard time limit.
4. The winner is the cell with the most images/s among those that trained and fit. Outputs (tune.md,
   tune.csv, tune.png, winner.txt, ds_config.json, the experiment preset) are written after every cell;
   running the same command again continues, measuring only cells without a result.

With `tune.objective=quality` the tune asks another question: which training settings (the
overrides given as sweeps: learning rate, rank, optimizer, precision, ...) reach the lowest
validation loss in `tune.budget`; quality.py says how that search goes.

Modules: `space` (the cells, their overrides, the planner's verdict, the winner), `run` (the tune's
course), `cell` (one cell measured in a process of its own), `outputs` (what a tune leaves in its
folder), `cli` (`python -m ds_trainer.tune`); for quality, `quality` (its course), `axes`, `study`,
`trial`, `quality_report`.
"""

from ds_trainer.tools.tune.cli import main

__all__ = ["main"]
