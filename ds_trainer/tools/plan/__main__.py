"""`python -m ds_trainer.tools.plan`: the same as `python -m ds_trainer.plan`."""

import sys

from ds_trainer.tools.plan.cli import main

sys.exit(main())
