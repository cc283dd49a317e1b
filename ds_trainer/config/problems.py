"""What a user reads when a configuration cannot run: a problem, the report of all of them, the error that
carries it. Torch-free, and imported by every layer that refuses a run (the checks, Hydra's overrides, a resume,
the tuner), so each says its mistakes in the same one-screen form.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import NoReturn

from omegaconf import DictConfig

from ds_trainer.config import distributed

_QUIET_RANK_WAIT_S = 20.0


@dataclass
class Problem:
    """One thing wrong with the configuration, as a user should read it."""

    key: str
    value: object
    why: str
    fix: str

    def render(self) -> str:
        return f"  - {self.key}={self.value}\n      why: {self.why}\n      fix: {self.fix}"


@dataclass
class Report:
    """The outcome of `config.checks.check`: the config to run (fallbacks applied), warnings, problems."""

    cfg: DictConfig
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        n = len(self.problems)
        head = f"ds_trainer: {n} problem{'s' if n != 1 else ''} in the configuration, nothing was run:"
        return "\n".join([head, *(p.render() for p in self.problems)])


class ConfigError(Exception):
    """A user mistake found before training; its message is the whole report."""


def first_problem(report: str) -> str:
    """The problems of a rendered report on one line each, without the heading (for a sweep table)."""
    lines = [line.strip().removeprefix("- ") for line in report.splitlines()[1:] if line.strip()]
    return "; ".join(lines)


def refuse(text: str) -> NoReturn:
    """Print the one-screen refusal and exit 2. Each machine says it once: the ranks a launcher starts on it
    checked the same configuration, so only its first local rank prints. The others give it time to: torchrun
    ends every rank once one exits, so a quiet rank leaving first would cut the message off."""
    if distributed.local_rank() == 0:
        print(text, file=sys.stderr)
        if distributed.under_torchrun():
            print("  (torchrun's own failure block follows, with this rank's `exitcode: 2`; check a configuration "
                  "before launching: python -m ds_trainer <overrides> world_size=<ranks> dry_run=true)",
                  file=sys.stderr, flush=True)
    elif distributed.under_torchrun():
        time.sleep(_QUIET_RANK_WAIT_S)  # torchrun's SIGTERM, once the first local rank has said it, ends this
    raise SystemExit(2)
