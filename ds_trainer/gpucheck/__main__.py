"""`python -m ds_trainer.gpucheck`: the code is in `ds_trainer/gpucheck/cli.py`."""

import sys

from ds_trainer.gpucheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
