"""`python -m ds_trainer.tools.bench`: the same as `python -m ds_trainer.bench`."""

import os
import sys

from ds_trainer.tools.bench.cli import main

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.exit(main())
