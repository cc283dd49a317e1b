"""`python -m ds_trainer.doctor [overrides]`: the pre-flight of a machine (the code: `ds_trainer/tools/doctor.py`)."""

import sys

from ds_trainer.tools.doctor import main

if __name__ == "__main__":
    sys.exit(main())
