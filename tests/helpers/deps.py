"""A system dependency a test needs (libaio, Slurm, root): missing, the test skips; under CI=true it fails."""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require(ok: bool, reason: str) -> None:
    """Skip when a system dependency is missing; under CI=true that is a failure, not a skip."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a test dependency is missing: {reason}")
    pytest.skip(reason)
