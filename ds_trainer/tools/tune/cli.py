"""`python -m ds_trainer.tune [training overrides] [tune.*]`: run a tune, exit 2 on bad input."""

from __future__ import annotations

import sys

from ds_trainer.tools.tune import run
from ds_trainer.tools.tune.space import BadInput


def main(argv: list[str] | None = None) -> int:
    """Compose like training, plan, measure, report; exit 2 on bad input, 1 when no cell trained."""
    try:
        return run.tune(list(sys.argv[1:] if argv is None else argv))
    except BadInput as exc:
        print(exc, file=sys.stderr)
        return 2
