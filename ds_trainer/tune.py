"""`python -m ds_trainer.tune`: the fastest configuration that fits, measured (code in `ds_trainer/tools/tune/`)."""

import sys

from ds_trainer.tools.tune import main

if __name__ == "__main__":
    sys.exit(main())
