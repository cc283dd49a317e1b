"""Command-line mistakes at Hydra's layer, reported like the config checks' problems. Torch-free.

Hydra parses the overrides and composes the config before our task function runs; its errors would
end in a traceback (`zero=2`: "Config group override must be a string or a list. Got int") or in
Hydra's own wording with exit status 1. `guarded` wraps every command that takes overrides:
- `check_args` reads the overrides with Hydra's own grammar first: a group given a number, a boolean,
  a list or an option that does not exist, several values without `-m`, a run or sweep folder that
  cannot be created. The natural spellings are named, not accepted: `zero=2` says `use zero=stage2`
  (an accepted alias would make `zero=2` and `zero=stage2` two spellings of one run in sweeps and logs).
- `explain` turns what Hydra still raises (unknown keys, wrong value types, a run folder it could not
  create) into the same message. Every message: key, value, why, fix; exit status 2; no traceback.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ds_trainer import CONF_DIR
from ds_trainer.config import presets
from ds_trainer.config.problems import Problem, Report, refuse

F = TypeVar("F", bound=Callable[..., Any])
_OURS = "_DS_TRAINER_FULL_ERROR_SET"  # we set HYDRA_FULL_ERROR ourselves (not the user)
# The option a user obviously meant where the value has no digits to match on.
_MEANT = {("offload", "true"): "cpu", ("offload", "false"): "none", ("logger", "true"): "wandb",
          ("logger", "false"): "none"}


class TaskFailed(Exception):
    """An exception from inside the task function (a bug or a training failure), not Hydra's layer."""


def render(problems: list[Problem]) -> str:
    """The same one-screen report as the config checks'."""
    import omegaconf

    return Report(omegaconf.OmegaConf.create(), problems).render()


def _is_group(key: str) -> bool:
    from hydra.core.config_store import ConfigStore

    return "/" in key or (CONF_DIR / key).is_dir() or key in ConfigStore.instance().repo


def group_options(group: str) -> list[str]:
    """The options of a config group: YAML files (conf/ and the user's presets), ConfigStore entries and (for
    hydra/...) plugins."""
    from hydra.core.config_store import ConfigStore

    from ds_trainer.config import rundir

    names = {p.stem for folder in (CONF_DIR, rundir.presets_dir()) for p in (folder / group).glob("*.yaml")}
    node: Any = ConfigStore.instance().repo
    for part in group.split("/"):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    names |= {n.removesuffix(".yaml") for n, v in node.items() if not isinstance(v, dict)}
    if group.startswith("hydra/"):
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        with _quiet_hydra(), initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            names |= set(GlobalHydra.instance().config_loader().get_group_options(group))
    return sorted(names)


@contextmanager
def _quiet_hydra() -> Iterator[None]:
    from hydra.core.global_hydra import GlobalHydra

    was = GlobalHydra.instance().is_initialized()
    saved = GlobalHydra.instance().hydra if was else None
    try:
        if was:
            GlobalHydra.instance().clear()
        yield
    finally:
        if saved is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(saved)


def meant(group: str, value: object, options: list[str]) -> list[str]:
    """Options the user probably meant: the same digits (`2` -> stage2, `1024` -> px1024), an obvious
    reading of a boolean, or a near spelling."""
    text = str(value).lower() if value is not None else "none"
    if (group, text) in _MEANT and _MEANT[group, text] in options:
        return [_MEANT[group, text]]
    if isinstance(value, float) and value.is_integer():
        text = str(int(value))
    digits = re.sub(r"\D", "", text)
    same = [o for o in options if digits and re.sub(r"\D", "", o) == digits]
    if same:
        return same
    if text in ("none", "null", "false") and "none" in options:
        return ["none"]
    return difflib.get_close_matches(text, options, n=2, cutoff=0.6)


def _group_problem(key: str, value: object) -> Problem | None:
    group = key.lstrip("+~")
    if isinstance(value, list):
        items = ",".join(map(str, value))
        return Problem(key, value, f"{group} is a config group; a list would merge its options into one config",
                       f"choose one option, or run each with -m: python -m ds_trainer -m {key}={items}")
    options = group_options(group)
    if isinstance(value, str) and value in options:
        return None
    kind = {bool: "a boolean", int: "a number", float: "a number", type(None): "null"}.get(type(value), "")
    kind = "an empty value" if value == "" else kind
    why = (f"{group} is a config group: its value names one of its options, not {kind}" if kind
           else f"{group} has no option {value!r}")
    why += f" (options: {', '.join(options)})" if options else ""
    near = meant(group, value, options)
    fix = " or ".join(f"{key}={o}" for o in near) if near else f"one of: {', '.join(f'{key}={o}' for o in options)}"
    if not options:
        from ds_trainer.config import rundir

        fix = (f"there are no {group} options yet; write {rundir.presets_dir() / group / str(value)}.yaml (python -m "
               f"ds_trainer.tune writes its winner there), or give the paths.outputs of the run that wrote it")
    return Problem(key, "" if value is None else value, why, "use " + fix if near else fix)


def _folder_problem(key: str, value: object) -> Problem | None:
    """A run or sweep folder that cannot be created or written (checked before Hydra creates it)."""
    text = str(value)
    if "${" in text or not text:
        return None
    path = Path(text).expanduser().absolute()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        why = f"{probe} is a file, so the folder {path} cannot be created"
    elif not os.access(probe, os.W_OK | os.X_OK):
        why = f"{probe} is not writable" if probe == path else f"cannot create {path}: {probe} is not writable"
    else:
        return None
    return Problem(key, text, why, f"{key}=<a folder you can write>, e.g. {key}=outputs/my_run")


def parse(argv: list[str]) -> tuple[list[str], bool]:
    """(overrides, multirun) from a command line, read by Hydra's own argument parser."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    overrides = list(args.overrides or [])
    # A named sweep (`+sweep=<name>`, sweeps/*.yaml) sets hydra.mode=MULTIRUN itself: no -m needed.
    named = any(o.split("=", 1)[0].lstrip("+~") == "sweep" or o.replace(" ", "") == "hydra.mode=MULTIRUN"
                for o in overrides)
    return overrides, bool(args.multirun) or named


def check_args(overrides: list[str], multirun: bool) -> list[Problem]:
    """Mistakes visible in the overrides themselves, before Hydra composes anything."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    problems: list[Problem] = []
    searchpath = any(a.lstrip("+").startswith("hydra.searchpath=") for a in overrides)
    for arg in overrides:
        try:
            (o,) = parser.parse_overrides([arg])
        except OverrideParseException as exc:
            why = str(exc).splitlines()[0]
            problems.append(Problem(arg.split("=", 1)[0], arg.partition("=")[2], f"cannot be parsed ({why})",
                                    "quote a value with spaces or special characters: key='a value'"))
            continue
        key, raw = o.get_key_element(), arg.partition("=")[2]
        if o.is_delete():
            continue
        if o.is_sweep_override() and not multirun:
            problems.append(Problem(key, raw, "several values are a sweep, which needs -m (--multirun)",
                                    f"python -m ds_trainer -m {arg}  (or one value: {key}=<value>)"))
            continue
        if _is_group(o.key_or_group) and not searchpath:  # other config folders may hold more options
            values = (o._value.list if isinstance(o._value, ChoiceSweep) else [o._value] if not o.is_sweep_override()
                      else [])
            for value in values:
                if (problem := _group_problem(key, value)) is not None:
                    problems.append(problem)
                elif (problem := presets.problem(key, o.key_or_group, str(value), overrides)):
                    problems.append(problem)  # a damaged file: one screen, not a traceback
        elif o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir") and not o.is_sweep_override():
            if (problem := _folder_problem(o.key_or_group, o.value())) is not None:
                problems.append(problem)
    return problems


def _value_of(key: str, overrides: list[str]) -> str:
    for arg in overrides:
        name, _, value = arg.partition("=")
        if name.lstrip("+~") == key:
            return value
    return "?"


def _known_keys(exc: Any) -> list[str]:
    kind = getattr(exc, "object_type", None)
    if kind is not None and dataclasses.is_dataclass(kind):
        return [f.name for f in dataclasses.fields(kind)]
    return []


def _as_list(key: str, both: str) -> Callable[[str], str]:
    def fix(value: str) -> str:
        return f"{key}=[{both if value in ('both', '') else value}]"
    return fix


# Keys that were renamed: the new key and the override that says the same.
RENAMED: dict[str, tuple[str, Callable[[str], str]]] = {
    "adapter.format": ("adapter.formats", _as_list("adapter.formats", "diffusers,kohya")),
    "export.format": ("export.formats", _as_list("export.formats", "diffusers,single_file")),
}


def explain(exc: BaseException, overrides: list[str], multirun: bool) -> Problem | None:
    """The problem a Hydra-layer exception stands for, or None when it is not a user mistake."""
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, ConfigKeyError | ConfigAttributeError | ValidationError) and getattr(cause, "full_key", None):
        key = str(cause.full_key)
        value = _value_of(key, overrides)
        if isinstance(cause, ConfigKeyError | ConfigAttributeError) and key in RENAMED:
            return Problem(key, value, f"is now {RENAMED[key][0]}, a list", RENAMED[key][1](value))
        if isinstance(cause, ConfigKeyError | ConfigAttributeError):
            leaf, parent = key.rsplit(".", 1)[-1], key.rpartition(".")[0]
            close = difflib.get_close_matches(leaf, _known_keys(cause), n=1)
            fix = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else \
                "remove it; `python -m ds_trainer --cfg job` lists every setting"
            owner = "a Hydra" if key.startswith("hydra.") else "a ds_trainer"
            return Problem(key, value, f"is not {owner} setting", fix)
        why = str(cause.msg).splitlines()[0] if getattr(cause, "msg", None) else str(cause).splitlines()[0]
        if value.startswith("[") and not multirun:
            fix = f"one value, or run each with -m: python -m ds_trainer -m {key}={value.strip('[]')}"
        elif "Integer" in why:
            fix = f"{key}=<an integer>" + (f", e.g. {key}={round(float(value))}"
                                          if re.fullmatch(r"-?\d+(\.\d*)?([eE]\d+)?", value) else "")
        elif "is not a ListConfig" in why:  # one value where a list goes (data.sources=/path)
            item = f"{{path: {value}}}" if key == "data.sources" else value
            why, fix = f"{key} is a list, and this is one value", f"{key}='[{item}]'"
        else:
            fix = f"{key}=<a valid value>"
        return Problem(key, value, why, fix)
    if isinstance(exc, AssertionError) and "Unexpected type for root: NoneType" in str(exc):
        return _into_null(exc, overrides)
    if isinstance(exc, MissingConfigException | ConfigCompositionException):
        text = (str(exc).splitlines() or [type(exc).__name__])[0]  # an exception may say nothing
        added = re.search(r"Could not override '([\w/]+)'\. No match in the defaults list", text)
        if added and _is_group(added.group(1)):  # a group no default selects (lever): added with +
            value = _value_of(added.group(1), overrides)
            return Problem(added.group(1), value, f"{added.group(1)} has no default to override; an option of it is "
                           "added to the configuration", f"+{added.group(1)}={value}")
        found = re.search(r"'([\w/]+)/([^'/]+)'", text)
        if found and _is_group(found.group(1)):
            return _group_problem(found.group(1), found.group(2)) or Problem(
                found.group(1), found.group(2), text, "check the option's name")
        return Problem("command line", " ".join(overrides), text, "fix the override it names")
    if isinstance(exc, OSError) and exc.filename is not None:
        return _unwritable(exc, overrides, multirun)
    if isinstance(exc, ValueError) and str(exc).startswith("Unable to configure"):
        # Python's logging.config, fed a Hydra logging option that lacks the handlers conf/config.yaml sets.
        given = [a for a in overrides if "logging" in a.split("=", 1)[0]] or ["hydra/job_logging=?"]
        key, _, value = given[0].lstrip("+").partition("=")
        return Problem(key, value, f"this logging option does not combine with ds_trainer's log handlers ({exc})",
                       f"leave {key} at its default, or {key}=none for no log output")
    if isinstance(exc, HydraException):
        return Problem("command line", " ".join(overrides), str(exc).splitlines()[0], "fix the override it names")
    return None


def _unwritable(exc: OSError, overrides: list[str], multirun: bool) -> Problem:
    """The run folder cannot be made: named by the key the user set, the run (or sweep) folder
    itself, else paths.outputs it lies under."""
    given = dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if key not in given:
        key = "paths.outputs"
    return Problem(key, given.get(key, "outputs"), f"the run folder {exc.filename} cannot be created "
                   f"or written ({exc.strerror})", f"{key}=<a folder you can write>")


def _into_null(exc: AssertionError, overrides: list[str]) -> Problem:
    """OmegaConf's update of a key under a block that is null here (`model.flow.shift=1` on an SDXL model, which has
    no flow block): the key OmegaConf was updating (its frame's), its override's value, and what would take it."""
    key = "command line"
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "update" and isinstance(tb.tb_frame.f_locals.get("key"), str):
            key = tb.tb_frame.f_locals["key"]
        tb = tb.tb_next
    if key == "command line":
        return Problem(key, " ".join(overrides), "an override sets a key under a block that is null here",
                       "drop the override, or pick a configuration where its block is set")
    parent = key.rsplit(".", 1)[0]
    hint = " (flow matching: model=sd3_tiny and the sd3 family have it)" if parent == "model.flow" else ""
    return Problem(key, _value_of(key, overrides), f"{parent} is null in this configuration, so it has no "
                   f"{key.rsplit('.', 1)[-1]}{hint}", f"drop {key}, or pick a configuration where {parent} is set")


def _interpolation_problem(exc: BaseException, overrides: list[str]) -> Problem | None:
    """An override's `${...}` that does not resolve surfaces inside the task, where the config is read."""
    from omegaconf.errors import InterpolationResolutionError

    given = [arg for arg in overrides if "${" in arg]
    if not isinstance(exc, InterpolationResolutionError) or not given:
        return None
    key, _, value = given[0].partition("=")
    return Problem(key, value, str(exc).splitlines()[0], "write the value itself, or ${key} of an existing key")


def task(fn: F) -> F:
    """Wrap the function `hydra.main` runs: inside it, Hydra's own error printing is back (our
    HYDRA_FULL_ERROR does not reach the processes it starts), and its exceptions are not Hydra's layer."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        ours = os.environ.get(_OURS) == "1"
        if ours:
            os.environ.pop("HYDRA_FULL_ERROR", None)
            os.environ.pop(_OURS, None)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            # Here, not after Hydra: Hydra would first log "Error executing job" for it.
            if (problem := _interpolation_problem(exc, parse(sys.argv[1:])[0])) is not None:
                refuse(render([problem]))
            if ours:
                raise TaskFailed(exc) from exc
            raise
        finally:
            if ours:
                os.environ["HYDRA_FULL_ERROR"] = os.environ[_OURS] = "1"

    return wrapped  # type: ignore[return-value]


def guarded(entry: Callable[[], Any], argv: list[str] | None = None) -> Any:
    """Run a `hydra.main` entry point so that a command-line mistake at any layer exits 2 with the
    one-screen message instead of a traceback. `argv` (default sys.argv[1:]) is what it parses."""
    argv = sys.argv[1:] if argv is None else argv
    overrides, multirun = parse(argv)
    if problems := check_args(overrides, multirun):
        refuse(render(problems))
    if "HYDRA_FULL_ERROR" in os.environ and os.environ.get(_OURS) != "1":
        return entry()  # the user asked for Hydra's full traces
    saved_argv = sys.argv
    sys.argv = [saved_argv[0], *argv]
    os.environ["HYDRA_FULL_ERROR"] = os.environ[_OURS] = "1"  # Hydra raises instead of printing
    try:
        return entry()
    except TaskFailed as failed:
        original = failed.__cause__ or failed
        traceback.print_exception(original)
        raise SystemExit(1) from None
    except Exception as exc:
        problem = explain(exc, overrides, multirun)
        if problem is None:
            raise
        refuse(render([problem]))
    finally:
        sys.argv = saved_argv
        os.environ.pop("HYDRA_FULL_ERROR", None)
        os.environ.pop(_OURS, None)


HELP = ("-h", "--help")


def answer_help(overrides: list[str], doc: str | None) -> None:
    """`--help` or `-h` to a tool that takes training's overrides: the first paragraphs of its
    docstring `doc` and where the overrides are described; exit 0."""
    if not any(arg in HELP for arg in overrides):
        return
    paragraphs = [p.strip("\n") for p in (doc or "").split("\n\n") if p.strip()]
    print("\n\n".join(paragraphs[:2]))
    print("\nOverrides as `python -m ds_trainer` takes them (key=value, group=option): "
          "`python -m ds_trainer --help` lists the groups, docs/config.md every key.")
    raise SystemExit(0)


def compose_checked(overrides: list[str], doc: str | None = None) -> Any:
    """`compose` for tools that take overrides without `hydra.main` (the planner): same messages;
    `--help` answered from the tool's docstring `doc`."""
    from hydra import compose, initialize_config_dir

    from ds_trainer import console

    answer_help(overrides, doc)

    console.install()  # Hydra's note of a presets folder not written yet is not for the terminal
    if problems := check_args(overrides, multirun=False):
        refuse(render(problems))
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except Exception as exc:
        problem = explain(exc, overrides, multirun=False)
        if problem is None:
            raise
        refuse(render([problem]))
