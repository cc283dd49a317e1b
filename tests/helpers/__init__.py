"""Helpers the tests import (pytest puts tests/ on sys.path): `from helpers.cli import run_cli`.

- cfg: composing configs from the repo's conf/, and every option on disk
- cli: running `python -m ds_trainer` (in a process of its own, or in this one), its run folders, its terminal
- ranks: starting ranks (torchrun, a free port, a one-rank process group in this process)
- procs: waiting on and stopping processes (wait_until, kill_9_at, SIGINT's default)
- deps: a missing system dependency skips, or fails under CI=true
- slurm: the jobs of a test on the local Slurm cluster
- numerics: how two runs that should agree are compared
- wandb_log: reading a W&B offline run file
- transformer_files: SD3's and Flux's single files in their makers' layouts

Fixtures and hooks stay in conftest.py; scripts the tests run as processes of their own are in tests/scripts/.
"""
