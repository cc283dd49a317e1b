"""The README and docs/ cannot rot: their links resolve, the config reference is the schemas', and every documented
command still composes and passes validation.

How a documented command is checked (every line of a fenced code block that runs `-m ds_trainer...`, with `\\`
continuations joined, a leading `$ ` and a trailing `# comment` dropped, torchrun/accelerate/slurm_local wrappers
looked through):
- `python -m ds_trainer ...`, `.plan`, `.tune`, `.doctor`: the overrides are parsed as the command line would be,
  then every cell (one, or each of a sweep: `-m` lists and a named `+sweep=`'s parameters) is composed and
  validated, as `dry_run=true` does, with the world size a torchrun line gives (a line that trains in one process
  may not set `world_size`: it would stop at its start, the ranks come from a launcher). Only one kind of problem is
  allowed: a path key (`data.path`, `model.pretrained`, `resume`, ...) naming a file of the user's that does not
  exist here (`/data/photos`, `<run>/checkpoints/step_N`: a `<placeholder>` or `$PWD` stands for such a path); every
  other key, value and combination must pass. A sweep's cells must all compose and at least one must pass: a cell
  validation refuses (offload under `zero=ddp` in `+sweep=zero_offload`) is an error row of the sweep's report, by
  design. A `+experiment=<name>` preset that a tune writes (not in `conf/experiment/`) is left out.
- `.report`, `.convert`, `.bench`, `.slurm_local` (they act on a sweep folder, a checkpoint, a GPU, the machine):
  every `--flag` and subcommand of the line must be one the command's `--help` lists.
- A command meant to fail sits in a code block announced by `<!-- expected to fail -->` on the line above its
  fence; it must fail validation, naming the keys the block's output shows.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import ds_trainer.cli  # noqa: F401 - registers the schemas and the launcher configs, as the CLI does
from ds_trainer import CONF_DIR
from ds_trainer.config import overrides, reference, validation

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
EXPECTED_TO_FAIL = "<!-- expected to fail -->"
# A line that runs something: environment assignments, then python, torchrun or accelerate.
COMMAND = re.compile(r"^([A-Z_]+=\S+\s+)*(python3?|torchrun|accelerate)\s")
# Keys that name the user's own files and folders: a documented placeholder path may be missing here.
USER_FILES = {"data.path", "validation.path", "model.pretrained", "model.vae", "resume", "samples.prompts",
              "adapter.init_from"}
CHECKED_BY_VALIDATION = {"ds_trainer", "ds_trainer.plan", "ds_trainer.tune", "ds_trainer.doctor"}
CHECKED_BY_HELP = {"ds_trainer.report", "ds_trainer.convert", "ds_trainer.bench", "ds_trainer.slurm_local",
                   "ds_trainer.tools.ops", "ds_trainer.config.reference"}


def _commands() -> list[tuple[str, str, str]]:
    """(where, command line, the block's text if it is expected to fail, else "") of every documented command."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            fails = block.group(1) if text[:block.start()].rstrip().endswith(EXPECTED_TO_FAIL) else ""
            line_no = text[:block.start()].count("\n") + 2
            for offset, line in enumerate(block.group(1).replace("\\\n", " ").splitlines()):
                line = re.sub(r"\s+#\s.*$", "", line.strip().removeprefix("$ "))
                if re.match(COMMAND, line) and re.search(r"-m ds_trainer(\.|\s|$)", line):
                    found.append((f"{page.relative_to(ROOT)}:{line_no + offset}", line, fails))
    return found


COMMANDS = _commands()


def _split(tokens: list[str]) -> list[tuple[str, list[str], int]]:
    """(module, its arguments, world size) of each ds_trainer command in a line, wrappers looked through."""
    out: list[tuple[str, list[str], int]] = []
    nproc = nnodes = 1
    for i, token in enumerate(tokens):
        if token in ("--nproc_per_node", "--nproc-per-node"):
            nproc = int(tokens[i + 1])
        elif token == "--nnodes":
            nnodes = int(tokens[i + 1])
        elif token == "-m" and tokens[i + 1].startswith("ds_trainer"):
            module, args = tokens[i + 1], tokens[i + 2:]
            launched = "torchrun" in tokens[:i]
            if module == "ds_trainer.slurm_local" and "--" in args:  # slurm_local exec ... -- <a command on a node>
                cut = args.index("--")
                return [(module, args[:cut], 1), *_split(args[cut + 1:])]
            return [*out, (module, args, nproc * nnodes if launched else 1)]
    return out


def _cells(args: list[str]) -> list[list[str]]:
    """The composed runs of a command line: one, or every cell of its sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given, multirun = overrides.parse(args)
    given = [o for o in given if not (o.startswith("+experiment=") and
                                      not (CONF_DIR / "experiment" / f"{o.split('=', 1)[1]}.yaml").is_file())]
    problems = overrides.check_args(given, multirun)
    assert not problems, validation.Report(None, problems).render()  # type: ignore[arg-type]
    axes: list[list[str]] = []
    fixed: list[str] = []
    for raw, parsed in zip(given, OverridesParser.create().parse_overrides(given), strict=True):
        if parsed.is_sweep_override():
            key = raw.split("=", 1)[0]
            axes.append([f"{key}={v}" for v in parsed.sweep_string_iterator()])
        else:
            fixed.append(raw)
    if any(o.lstrip("+").startswith("sweep=") for o in fixed):  # a named sweep: its parameters are the axes
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=fixed, return_hydra_config=True)
        for key, values in cfg.hydra.sweeper.params.items():
            axes.append([f"{key}={v.strip()}" for v in str(values).split(",")])
    return [[*fixed, *cell] for cell in itertools.product(*axes)] if axes else [fixed]


def _problems(cell: list[str], world_size: int) -> list[validation.Problem]:
    cell = [*cell, *([f"world_size={world_size}"] if world_size > 1 else [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=cell)
    return validation.check(cfg).problems


@cache
def _help(module: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_docs_document_commands_of_every_kind() -> None:
    modules = {module for _, line, _ in COMMANDS for module, _, _ in _split(shlex.split(line))}
    assert {"ds_trainer", "ds_trainer.plan", "ds_trainer.tune", "ds_trainer.convert", "ds_trainer.report",
            "ds_trainer.doctor"} <= modules
    assert modules <= CHECKED_BY_VALIDATION | CHECKED_BY_HELP, modules - CHECKED_BY_VALIDATION - CHECKED_BY_HELP
    assert any(fails for _, _, fails in COMMANDS)  # the failing example of troubleshooting.md is checked too


@pytest.mark.parametrize(("where", "line", "fails"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_documented_command_composes_and_passes_validation(where: str, line: str, fails: str) -> None:
    line = re.sub(r"\[(--[\w-]+)\]", r"\1", line)  # an optional flag: [--ema]
    line = re.sub(r"<[^>]+>", "PLACEHOLDER", line).replace("$PWD", "PLACEHOLDER")  # the user's <run> and such
    tokens = [t for t in shlex.split(line) if t != "..."]
    cut = [i for i, t in enumerate(tokens) if t in ("&", "&&", ";", "|", ">", "2>")]  # the shell's, not ours
    tokens = tokens[:cut[0]] if cut else tokens
    for module, args, world_size in _split(tokens):
        if module in CHECKED_BY_HELP:
            text = _help(module)
            for arg in args:
                flag = arg.split("=", 1)[0]
                if flag.startswith("--") or (module == "ds_trainer.slurm_local" and arg == args[0]):
                    assert flag.rstrip("]") in text, f"{where}: {module} has no {flag} ({line})"
            continue
        if module == "ds_trainer" and world_size == 1 and "dry_run=true" not in args:
            # One process stops at its start with "leave world_size unset": ranks come from a launcher.
            assert not any(a.startswith("world_size=") and a != "world_size=1" for a in args), (
                f"{where}: {line} trains in one process; start the ranks with torchrun --nproc_per_node N")
        cells = _cells(args)
        by_cell = [_problems(cell, world_size) for cell in cells]
        if len(cells) > 1:  # a sweep: every cell composed; a refused cell is an error row of its report, by design
            assert any(not p for p in by_cell), f"{where}: no cell of the sweep passes validation: {line}"
            continue
        problems = by_cell[0]
        if fails:
            shown = set(re.findall(r"^\s*- ([\w.]+)=", fails, re.M))  # the keys the page's output names
            assert shown and shown == {p.key for p in problems}, f"{where}: {line} fails otherwise than shown"
            continue
        wrong = [p for p in problems if not (p.key in USER_FILES and not Path(str(p.value)).exists())]
        assert not wrong, f"{where}: {line}\n" + validation.Report(None, wrong).render()  # type: ignore[arg-type]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.*)$", text, re.M)}


def test_every_relative_link_of_the_readme_and_docs_resolves() -> None:
    broken, checked = [], 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert checked >= 15 and not broken, broken  # the README links every capability's page


def test_the_readme_is_a_map_that_links_every_page_of_docs() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "## The two commands" in text and "make run" in text and "make test" in text  # CI reads them there
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in text, f"README.md does not link docs/{page.name}"


def test_the_config_reference_is_the_schemas_and_names_every_key() -> None:
    committed = reference.PAGE.read_text()
    missing = [key for key, _, _, _ in reference.keys() if f"`{key}`" not in committed]
    assert not missing, f"docs/config.md lacks {missing[:10]}: run python -m ds_trainer.config.reference --write"
    assert committed == reference.render(), ("docs/config.md is not what the schemas and conf/ say: run "
                                             "python -m ds_trainer.config.reference --write")
    for group in ("zero", "offload", "optimizer", "precision", "adapter", "validation"):
        for option in (CONF_DIR / group).glob("*.yaml"):
            assert f"`{group}={option.stem}`" in committed
