"""The jobs of a test on the local Slurm cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

ACTIVE_STATES = "PENDING,RUNNING,CONFIGURING,REQUEUED,COMPLETING"


def slurm_jobs(env: dict[str, str], workdir: Path, states: str = "PENDING,RUNNING,CONFIGURING,REQUEUED") -> list[str]:
    """The ids of this test's jobs (submitted from `workdir`) in `states`: a job of the previous test may still
    be completing (state CG, for seconds on a loaded machine), and squeue lists it by default."""
    out = subprocess.run(["squeue", "-h", "-t", states, "-o", "%i|%Z"], env=env, capture_output=True,
                         text=True).stdout
    mine = str(workdir.resolve())
    return [job for job, _, folder in (line.partition("|") for line in out.splitlines())
            if Path(folder).resolve().is_relative_to(mine)]
