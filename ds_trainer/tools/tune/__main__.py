"""`python -m ds_trainer.tools.tune`: the same as `python -m ds_trainer.tune`."""

import sys

from ds_trainer.tools.tune.cli import main

sys.exit(main())
