"""A config group's option file, read before Hydra composes it. Torch-free.

A preset a user wrote, copied or got from a teammate (`<paths.outputs>/presets/<group>/<name>.yaml`,
or one of conf/'s) that is not UTF-8, not YAML, not a mapping, or an experiment preset without its
package line, is refused on one screen naming the file. Hydra raised a traceback for the first two
(yaml's ParserError, UnicodeDecodeError) and said `Key 'experiment' not in 'Config'` for the last.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ds_trainer import CONF_DIR
from ds_trainer.config import rundir
from ds_trainer.config.problems import Problem

GLOBAL = frozenset({"experiment", "lever"})  # groups whose options set the run's own keys
PACKAGE_LINE = "# @package _global_"


def package(text: str) -> str | None:
    """The `@package` a YAML file's header declares (its comment lines before the first setting, as
    Hydra reads them), or None."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return None
        if line.startswith("# @package"):
            return line.removeprefix("# @package").strip()
    return None


def file_of(group: str, option: str, argv: list[str] | None = None) -> Path | None:
    """The file Hydra would read for `group=option`: conf/'s, else the user's presets folder's."""
    for folder in (CONF_DIR, rundir.presets_dir(argv=argv)):
        path = folder / group / f"{option}.yaml"
        if path.exists() or path.is_symlink():
            return path
    return None


def problem(key: str, group: str, option: str, argv: list[str] | None = None) -> Problem | None:
    """What is wrong with the file of `group=option` (`key` as the command line has it), or None."""
    path = file_of(group, option, argv)
    if path is None:
        return None
    fix = f"repair or remove {path} (python -m ds_trainer.tune tune.name={option} writes a preset)"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        return Problem(key, option, f"its file {path} cannot be read ({exc.strerror or exc})", fix)
    except UnicodeDecodeError as exc:
        return Problem(key, option, f"its file {path} is not UTF-8 text (byte {exc.start} is "
                       f"0x{exc.object[exc.start]:02x}): not a YAML preset", fix)
    try:
        content = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        said = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return Problem(key, option, f"its file {path} is not valid YAML{where}: {said}", fix)
    if content is not None and not isinstance(content, dict):
        return Problem(key, option, f"its file {path} holds a {type(content).__name__}, not a "
                       "mapping of settings", fix)
    if group in GLOBAL and package(text) != "_global_":
        return Problem(key, option, f"its file {path} does not start with `{PACKAGE_LINE}`, so "
                       f"Hydra puts its settings under `{group}.` instead of the run's own keys",
                       f"add `{PACKAGE_LINE}` as the first line of {path} (the tuner writes it so)")
    return None
