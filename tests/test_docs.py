"""The README and docs/ cannot rot: their links resolve, the config reference is the schemas', and every documented
command still composes and passes validation.

Which commands: every line of a fenced code block that runs `-m ds_trainer...` (`\\` continuations joined, a leading
`$ ` and a trailing `# comment` dropped), and every `python -m ds_trainer...` span in the running text that gives
arguments (a bare `python -m ds_trainer.plan` names the tool). A line that appears on several pages is checked once,
naming every place. torchrun, accelerate launch and `slurm_local exec ... --` wrappers are looked through.

How each is checked, without training anything:
- `python -m ds_trainer ...`, `.plan`, `.tune`, `.doctor`: the overrides are parsed as the command line would be,
  then every cell (one, or each of a sweep: `-m` lists and a named `+sweep=`'s parameters) is composed and
  validated, with the world size a torchrun line gives (a line that trains in one process may not set
  `world_size`: it would stop at its start, the ranks come from a launcher). Only one kind of problem is allowed:
  a path key (`data.path`, `model.pretrained`, `resume`, ...) naming a file of the user's that does not exist here
  (`/data/photos`, `<run>/checkpoints/step_N`: a `<placeholder>` or `$PWD` stands for such a path; a placeholder
  on its own, `<the run's overrides>`, stands for none); every other key, value and combination must pass. A
  `python -m ds_trainer` line that passes then runs for real with `dry_run=true` (in this process, its run
  directory under the test's tmp folder): exit 0, `config.yaml` written, and `ds_config.json` for DeepSpeed. A line
  with a missing user path is checked up to validation only. The planner, tuner and doctor are checked up to
  validation, their own first step. A sweep's cells must all compose and at least one must pass validation (no
  cell is dry-run: a sweep starts processes): a cell validation refuses (offload under `zero=ddp` in
  `+sweep=zero_offload`) is an error row of the sweep's report, by design. A `+experiment=<name>` preset that a
  tune writes (not in `conf/experiment/`) is left out.
- `.report`, `.convert`, `.bench`, `.slurm_local`, `.config.docs_reference` (they act on a sweep folder, a checkpoint, a
  GPU, the machine, docs/): the line's arguments go through the command's own argparse parser, stopped right
  after it (every flag, value type, choice and positional as the command reads them); a span in running text need
  only name flags the command has. `.tools.ops`: every argument is an op it builds.
- A command meant to fail sits in a code block announced by `<!-- expected to fail -->` on the line above its
  fence, the command on its first line (`$ python -m ...`) and what it prints below: its dry run must exit 2 and
  print exactly that.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import itertools
import re
import shlex
from pathlib import Path

import pytest
from helpers.cli import cli_in_process
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import ds_trainer.cli  # noqa: F401 - registers the schemas and the launcher configs, as the CLI does
from ds_trainer import CONF_DIR
from ds_trainer.config import checks, docs_reference, overrides
from ds_trainer.config.problems import Problem, Report
from ds_trainer.tools.tune import axes as tune_axes

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
EXPECTED_TO_FAIL = "<!-- expected to fail -->"
# A line that runs something: environment assignments, then python (maybe .venv/bin/python), torchrun or accelerate.
COMMAND = re.compile(r"^([A-Z_]+=\S+\s+)*(\S*/)?(python3?|torchrun|accelerate)\s")
RUNS_DS_TRAINER = re.compile(r"-m ds_trainer(\.|\s|$)")
# Keys that name the user's own files and folders: a documented placeholder path may be missing here.
USER_FILES = {"data.path", "validation.path", "model.pretrained", "model.vae", "model.transformer", "resume",
              "samples.prompts", "adapter.init_from", "data.control_path", "samples.images"}
CHECKED_BY_VALIDATION = {"ds_trainer", "ds_trainer.cache", "ds_trainer.plan", "ds_trainer.tune", "ds_trainer.doctor"}
CHECKED_BY_PARSER = {"ds_trainer.report", "ds_trainer.convert", "ds_trainer.bench", "ds_trainer.slurm_local",
                     "ds_trainer.gpucheck", "ds_trainer.gpucheck.rehearse",
                     "ds_trainer.config.docs_reference", "ds_trainer.config.refusals", "ds_trainer.tools.plan.table"}
CHECKED_BY_NAME = {"ds_trainer.tools.ops"}


def _commands() -> dict[tuple[str, bool, str], list[str]]:
    """{(command line, whether it is a span of running text, the output its page shows if it is expected to fail):
    [every page:line it is on]}."""
    found: dict[tuple[str, bool, str], list[str]] = {}
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT)
        for block in FENCE.finditer(text):
            fails = text[:block.start()].rstrip().endswith(EXPECTED_TO_FAIL)
            line_no = text[:block.start()].count("\n") + 2
            lines = block.group(1).replace("\\\n", " ").splitlines()
            for offset, line in enumerate(lines):
                line = re.sub(r"\s+#\s.*$", "", line.strip().removeprefix("$ "))
                if re.match(COMMAND, line) and re.search(RUNS_DS_TRAINER, line):
                    shown = "\n".join(lines[offset + 1:]).strip() if fails else ""
                    found.setdefault((line, False, shown), []).append(f"{name}:{line_no + offset}")
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # the running text, its line numbers kept
        for span in re.finditer(r"`([^`\n]+)`", prose):
            line = span.group(1).strip()
            bare = re.sub(r"\s+\.\.\.$", "", line)
            if re.match(COMMAND, line) and re.search(RUNS_DS_TRAINER, line) and not re.fullmatch(r"\S+ -m \S+", bare):
                found.setdefault((line, True, ""), []).append(f"{name}:{prose[:span.start()].count(chr(10)) + 1}")
    return found


COMMANDS = _commands()


def _tokens(line: str) -> list[str]:
    """The words of a command line as the shell splits them, its placeholders and shell operators taken out."""
    line = re.sub(r"\[(--[\w-]+)\]", r"\1", line)  # an optional flag: [--ema]
    line = re.sub(r"<[^>]+>", "PLACEHOLDER", line).replace("$PWD", "PLACEHOLDER")  # the user's <run> and such
    tokens = [t for t in shlex.split(line) if t != "..."]
    cut = [i for i, t in enumerate(tokens) if t in ("&", "&&", ";", "|", ">", "2>")]  # the shell's, not ours
    return tokens[:cut[0]] if cut else tokens


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


def _cells(args: list[str], module: str = "ds_trainer") -> list[list[str]]:
    """The composed runs of a command line: one, or every cell of its sweep (a quality tune's: its axes' ends)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given, multirun = overrides.parse(args)
    given = [o for o in given if not (o.startswith("+experiment=") and
                                      not (CONF_DIR / "experiment" / f"{o.split('=', 1)[1]}.yaml").is_file())]
    if module == "ds_trainer.tune" and len(lines := tune_axes.corners(given)) > 1:
        refused = tune_axes.split(given)[2]  # the tune reads its sweeps as the axes of a search
        assert not refused, Report(None, refused).render()  # type: ignore[arg-type]
        return lines  # each end composes, one passes
    problems = overrides.check_args(given, multirun)
    assert not problems, Report(None, problems).render()  # type: ignore[arg-type]
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


def _problems(cell: list[str], world_size: int) -> list[Problem]:
    cell = [*cell, *([f"world_size={world_size}"] if world_size > 1 else [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=cell)
    return checks.check(cfg).problems


def _dry_run(cell: list[str], world_size: int, tmp: Path) -> tuple[int, str, Path]:
    """(exit status, what it printed, its run directory) of `python -m ds_trainer <cell> dry_run=true`, run in this
    process (helpers.cli.cli_in_process) with its run directory and outputs under `tmp`."""
    run_dir = tmp / "run"
    own = ("hydra.run.dir", "paths.outputs", "dry_run")  # where it writes: ours; the line's are checked above
    argv = [a for a in cell if a.split("=", 1)[0].lstrip("+") not in own]
    if world_size > 1 and not any(a.startswith("world_size=") for a in argv):
        argv.append(f"world_size={world_size}")
    argv += ["dry_run=true", f"hydra.run.dir={run_dir}", f"paths.outputs={tmp / 'outputs'}"]
    code, printed = cli_in_process(argv, tmp)
    return code, printed, run_dir


class _Parsed(Exception):
    """Raised in place of argparse's `parse_args`: the command got as far as reading its arguments, and no further."""


def _parser(module: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[argparse.ArgumentParser, list]:
    """The argparse parser of a command's `main` and the arguments it would read, stopped before it reads them."""
    def stop(self: argparse.ArgumentParser, args: list[str] | None = None, namespace: object = None) -> None:
        raise _Parsed(self, args)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            importlib.import_module(module).main(args)
        except _Parsed as parsed:
            return parsed.args[0], list(parsed.args[1])
    raise AssertionError(f"{module}.main returned without reading its arguments with argparse")


def _check_arguments(module: str, args: list[str], inline: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    """What is wrong with the arguments of a command that is not composed by Hydra ("" when nothing is)."""
    if module in CHECKED_BY_NAME:
        from ds_trainer.tools import ops

        return ", ".join(f"{a} is not an op it builds ({ops.OPS})" for a in args if a not in ops.OPS)
    parser, received = _parser(module, args, monkeypatch)
    if inline:  # running text may name a flag without the rest of the command
        flags = {flag for action in parser._actions for flag in action.option_strings}
        return ", ".join(f"{module} has no {a}" for a in args if a.startswith("-") and a.split("=")[0] not in flags)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser.parse_args(received)
        except SystemExit:
            return err.getvalue()
    return ""


def test_the_docs_document_commands_of_every_kind() -> None:
    modules = {module for line, _, _ in COMMANDS for module, _, _ in _split(_tokens(line))}
    assert {"ds_trainer", "ds_trainer.plan", "ds_trainer.tune", "ds_trainer.convert", "ds_trainer.report",
            "ds_trainer.doctor"} <= modules
    known = CHECKED_BY_VALIDATION | CHECKED_BY_PARSER | CHECKED_BY_NAME
    assert modules <= known, f"no check for {modules - known}: add the module to one of the sets above"
    assert any(shown for _, _, shown in COMMANDS)  # the failing example of troubleshooting.md is checked too
    assert any(inline for _, inline, _ in COMMANDS)  # and the commands of the running text


@pytest.mark.parametrize(("line", "inline", "shown"), list(COMMANDS), ids=[where[0] for where in COMMANDS.values()])
def test_a_documented_command_composes_and_passes_validation(line: str, inline: bool, shown: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    where = f"{', '.join(COMMANDS[(line, inline, shown)])}: {line}"
    monkeypatch.chdir(tmp_path)  # what validation creates (the default offload.nvme_path) lands here, not in the repo
    for module, args, world_size in _split(_tokens(line)):
        if module not in CHECKED_BY_VALIDATION:
            misread = _check_arguments(module, args, inline, monkeypatch)
            assert not misread, f"{where}\n{misread}"
            continue
        args = [a for a in args if a != "PLACEHOLDER"]  # <the run's overrides>: whatever the user gives
        if module == "ds_trainer" and world_size == 1 and "dry_run=true" not in args:
            # One process stops at its start with "leave world_size unset": ranks come from a launcher.
            assert not any(a.startswith("world_size=") and a != "world_size=1" for a in args), (
                f"{where}: trains in one process; start the ranks with torchrun --nproc_per_node N")
        cells = _cells(args, module)
        by_cell = [_problems(cell, world_size) for cell in cells]
        if len(cells) > 1:  # a sweep: every cell composed; a refused cell is an error row of its report, by design
            assert any(not p for p in by_cell), f"{where}: no cell of the sweep passes validation"
            continue
        if shown:  # meant to fail: it does, and prints what its page shows
            code, printed, _ = _dry_run(cells[0], world_size, tmp_path)
            assert (code, printed.strip()) == (2, shown), f"{where}: fails otherwise than its page shows"
            continue
        wrong = [p for p in by_cell[0] if not (_user_file(p.key) and not Path(str(p.value)).exists())]
        assert not wrong, f"{where}\n" + Report(None, wrong).render()  # type: ignore[arg-type]
        if module == "ds_trainer" and not by_cell[0]:
            code, printed, run_dir = _dry_run(cells[0], world_size, tmp_path)
            assert code == 0, f"{where}: its dry run exits {code}:\n{printed[-3000:]}"
            backend = OmegaConf.load(run_dir / "config.yaml").resolved.backend
            assert backend != "deepspeed" or (run_dir / "ds_config.json").is_file(), where


PLANNED = sorted({tuple(args) for line, inline, _ in COMMANDS if not inline
                  for module, args, _ in _split(_tokens(line))
                  if module == "ds_trainer.plan" and "PLACEHOLDER" not in args})


@pytest.mark.parametrize("args", PLANNED, ids=[" ".join(a) for a in PLANNED])
def test_a_documented_planner_command_runs_and_prints_its_table(args: tuple[str, ...], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The planner's documented lines run end to end, as written (the architectures on the meta device,
    no weights): each prints its table, exit 0."""
    from ds_trainer.tools.plan import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(list(args)) == 0
    out = capsys.readouterr().out
    assert out.startswith("ds_trainer plan: ") and "stage2" in out, out[-2000:]


def _user_file(key: str) -> bool:
    """A key naming the user's own files (a documented command's example path need not exist here)."""
    return key in USER_FILES or re.fullmatch(r"data\.sources\[\d+\]\.path", key) is not None


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


def test_the_refusals_page_is_the_rules() -> None:
    """docs/refusals.md lists every Problem the rule modules return, from their source: a rule added or changed
    without the page fails here."""
    from ds_trainer.config import refusals

    committed = refusals.PAGE.read_text()
    assert committed == refusals.render(), ("docs/refusals.md is not what the rules say: run "
                                            "python -m ds_trainer.config.refusals --write")
    # The rules of this round's GPU review are on it, with their fixes
    for said in ("bitsandbytes' 8-bit kernels count", "T5 overflows in fp16", "keeps d as a CUDA scalar"):
        assert said in committed
    assert len(refusals.refusals("config/checks/optimizer.py")) >= 18


def test_the_config_reference_is_the_schemas_and_names_every_key() -> None:
    committed = docs_reference.PAGE.read_text()
    missing = [key for key, _, _, _ in docs_reference.keys() if f"`{key}`" not in committed]
    assert not missing, f"docs/config.md lacks {missing[:10]}: run python -m ds_trainer.config.docs_reference --write"
    assert committed == docs_reference.render(), ("docs/config.md is not what the schemas and conf/ say: run "
                                             "python -m ds_trainer.config.docs_reference --write")
    for group in ("zero", "offload", "optimizer", "precision", "adapter", "validation"):
        for option in (CONF_DIR / group).glob("*.yaml"):
            assert f"`{group}={option.stem}`" in committed
