"""Composing configs from the repo's conf/ as the CLI does (conftest.py registers the schemas first)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ds_trainer import CONF_DIR


def group_options() -> list[tuple[str, str]]:
    """(group, option) for every option file on disk, so a new YAML is tested without anyone listing it."""
    return sorted((d.name, f.stem) for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra"
                  for f in d.glob("*.yaml"))


def make_cfg(*overrides: str) -> DictConfig:
    """The composed config of `overrides`, as `python -m ds_trainer` would compose it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))
