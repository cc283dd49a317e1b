"""`python -m ds_trainer.tune`: the fastest configuration that fits, measured, or (tune.objective=quality) the
settings that reach the lowest validation loss in a budget (code in `ds_trainer/tools/tune/`)."""

import sys

from ds_trainer.tools.tune import main

if __name__ == "__main__":
    sys.exit(main())
