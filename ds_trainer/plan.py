"""`python -m ds_trainer.plan`: the memory planner (the code is in `ds_trainer/tools/plan/`)."""

import sys

from ds_trainer.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
