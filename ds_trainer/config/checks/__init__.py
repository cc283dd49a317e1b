"""The composed config, checked as a whole before anything heavy runs. Torch-free.

Two steps. `resolve` decides what runs: the few fallbacks that change the config (each said as a warning and
recorded under `resolved:`) and the facts the run reads. Then the rule modules, by group, only read that config and
each returns `list[Problem]`; every problem is reported at once, each naming the key, the value, why, and the
override that fixes it.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ds_trainer.config import buckets, hardware, holdout, samples
from ds_trainer.config.checks import (
    adapter,
    backend,
    model,
    ops,
    optimizer,
    parallel,
    paths,
    precision,
    reference,
    resolve,
    settings,
    swap,
    video,
)
from ds_trainer.config.problems import Problem, Report


def check(cfg: DictConfig, info: hardware.PlatformInfo | None = None) -> Report:
    """Check `cfg` as a whole (on `info`'s platform, else this machine's); the report holds the resolved copy,
    its warnings and every problem."""
    cfg, info, warnings = resolve.resolve(cfg, info)
    problems: list[Problem] = [*settings.problems(cfg), *model.problems(cfg), *video.problems(cfg),
                               *buckets.problems(cfg),
                               *precision.problems(cfg, info), *backend.problems(cfg, info),
                               *optimizer.problems(cfg, info), *parallel.problems(cfg)]
    if not problems:  # the swap is sized, and its disk asked, only for a config that otherwise runs
        resolve.size_swap(cfg)
        problems += swap.problems(cfg, info)
    problems += [*paths.problems(cfg), *reference.problems(cfg), *adapter.problems(cfg, info), *samples.problems(cfg),
                 *holdout.problems(cfg)]
    if not problems:  # the last question, the slowest: can this machine build the DeepSpeed ops the run loads
        problems += ops.problems(cfg)
    return Report(cfg, problems, warnings)
