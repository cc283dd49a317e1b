"""Hydra launcher plugin: the submitit launchers, with cells that come back.

Installed as `hydra_plugins.ds_trainer_launcher` (Hydra looks for plugins only in that namespace; see
pyproject.toml). `ds_trainer.cli` imports and registers it explicitly, which also covers editable
installs, where Hydra's plugin scan does not see it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

_MODULE = "hydra_plugins.ds_trainer_launcher.launcher"


@dataclass
class ResubmittingSlurmConf(SlurmQueueConf):
    _target_: str = f"{_MODULE}.SlurmLauncher"
    # A cell whose job ends without finishing (scancel, a node failure, the out-of-memory killer, SIGTERM)
    # is submitted again up to this many times; it resumes from its latest checkpoint. Time limits and
    # preemption signals are submitit's requeue (max_num_timeout), which keeps the job id.
    max_resubmits: int = 3


@dataclass
class ResubmittingLocalConf(LocalQueueConf):
    _target_: str = f"{_MODULE}.LocalLauncher"
    max_resubmits: int = 3


def register() -> None:
    """The launcher configs (`hydra/launcher=ds_submitit_slurm`, `ds_submitit_local`) and classes."""
    from hydra.core.plugins import Plugins
    from hydra_plugins.ds_trainer_launcher.launcher import LocalLauncher, SlurmLauncher

    for launcher in (LocalLauncher, SlurmLauncher):
        Plugins.instance().register(launcher)
    store = ConfigStore.instance()
    store.store(group="hydra/launcher", name="ds_submitit_slurm", node=ResubmittingSlurmConf, provider="ds_trainer")
    store.store(group="hydra/launcher", name="ds_submitit_local", node=ResubmittingLocalConf, provider="ds_trainer")
