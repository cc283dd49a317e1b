"""`python -m ds_trainer.report`: the sweep report (the code is in `ds_trainer/launch/report.py`)."""

import sys

from ds_trainer.launch.report import main

if __name__ == "__main__":
    sys.exit(main())
