"""`python -m ds_trainer.tune [training overrides] [tune.*]`: the fastest configuration that fits.

Takes the same overrides as training, and tune.* (the axes: tune.zero, tune.offload,
tune.micro_batch_size, ...; tune.global_batch, the time limit per cell); each cell the checks and
the planner keep runs a short real training; the winner, tune.md and the preset are written as it
goes (docs/tuner.md). With tune.objective=quality: the settings given as sweeps
('optimizer.lr=tag(log,interval(1e-5,1e-3))' adapter.rank=8,16,32 ...) that reach the lowest
validation loss in tune.budget (8h, or 4000steps) or tune.trials, trials pruned at rungs of
validation.every, tune.workers side by side. Exit 2 on bad input, 1 when no cell (no trial)
trained."""

from __future__ import annotations

import sys

from ds_trainer.tools.tune import run
from ds_trainer.tools.tune.space import BadInput


def main(argv: list[str] | None = None) -> int:
    """Compose like training, plan, measure, report; exit 2 on bad input, 1 when no cell trained."""
    try:
        return run.tune(list(sys.argv[1:] if argv is None else argv), __doc__)
    except BadInput as exc:
        print(exc, file=sys.stderr)
        return 2
