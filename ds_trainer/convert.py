"""`python -m ds_trainer.convert`: export and import checkpoints (the code is in `ds_trainer/tools/convert.py`)."""

import sys

from ds_trainer.tools.convert import main

if __name__ == "__main__":
    sys.exit(main())
