"""`python -m ds_trainer.slurm_local`: a local Slurm cluster (the code is in `ds_trainer/launch/slurm_local.py`)."""

import sys

from ds_trainer.launch.slurm_local import main

if __name__ == "__main__":
    sys.exit(main())
