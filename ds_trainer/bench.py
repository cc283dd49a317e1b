"""`python -m ds_trainer.bench`: the GPU benchmark (the code is in `ds_trainer/tools/bench/`)."""

import os
import sys

from ds_trainer.tools.bench import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
