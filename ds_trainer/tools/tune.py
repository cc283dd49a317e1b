"""The fastest configuration that fits, measured: `python -m ds_trainer.tune [training overrides] [tune.*]`.

1. The space: tune.zero x tune.offload x tune.micro_batch_size x tune.gradient_checkpointing (x tune.optimizer
   when given), the
   accumulation derived from tune.global_batch (images per optimizer step) or, when that is null, the
   training's own. An axis set on the command line (e.g. `zero=stage3`) is held at that value.
2. Cells the configuration check rejects are dropped (`invalid`); the planner (tools/plan.py, calibrated
   by earlier tunes) drops those it predicts above the budget (`pruned`) before anything runs.
3. The rest run one at a time, likely winners first (lower ZeRO ladder rung, no checkpointing, larger
   micro batch), each a short real training (tools/tune_cell.py) under a hard time limit.
4. The winner is the cell with the most images/s among those that trained and fit. Outputs (tune.md,
   tune.csv, tune.png, winner.txt, ds_config.json, the experiment preset) are written after every cell;
   running the same command again continues, measuring only cells without a result.
"""

from __future__ import annotations

import sys

from ds_trainer.tools import tune_run
from ds_trainer.tools.tune_space import BadInput


def main(argv: list[str] | None = None) -> int:
    """Compose like training, plan, measure, report; exit 2 on bad input, 1 when no cell trained."""
    try:
        return tune_run.tune(list(sys.argv[1:] if argv is None else argv))
    except BadInput as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
