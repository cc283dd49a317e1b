"""Running `python -m ds_trainer` as a user would (a process of its own) or in this process, finding its run
folders, and reading what it printed on the terminal."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 600,
            module: str = "ds_trainer") -> subprocess.CompletedProcess[str]:
    """Run `python -m ds_trainer ARGS` as a user would, from `cwd`."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# What a run may print on the terminal (stderr): ds_trainer's log lines, its progress bar, its closing summary
# (indented lines under "ds_trainer: <status>"), W&B's own lines. Anything else (a library's warning, a
# traceback's first line) is chatter a user should not have to read.
OUR_LINE = re.compile(r"\[[^]]+\]\[ds_trainer(\.[\w.]+)?\]\[[A-Z]+\] - |ds_trainer: |wandb: |  \S|$")
PROGRESS_BAR = re.compile(r"(?:train|sampling \d+ images?):\s+\d+%\|[^|]*\|\s*\d+/\d+\s*\[[^\]]*\]")


def terminal_chatter(stderr: str) -> list[str]:
    """The lines of a run's stderr that are not ds_trainer's. The progress bar's redraws (carriage returns) are
    split apart, and what was printed right after a bar's text (no newline in between) is judged on its own."""
    chatter = []
    for line in (part for row in stderr.splitlines() for part in row.split("\r")):
        while bar := PROGRESS_BAR.match(line):
            line = line[bar.end():].lstrip(" ")  # tqdm pads a redraw with spaces over the longer one before
        if not OUR_LINE.match(line):
            chatter.append(line)
    return chatter


def run_dirs(root: Path) -> list[Path]:
    """The run directories under `root`'s outputs/, oldest first."""
    return sorted(p.parent for p in (root / "outputs" / "runs").glob("*/*/config.yaml"))



def cli_in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """(exit status, what it printed) of `python -m ds_trainer <argv>` run in this process from `cwd`: fast, for
    commands that stop before training (a dry run, a refused configuration). What the run leaves in the process is
    undone after it."""
    from ds_trainer import cli

    out = io.StringIO()
    old, environ, sigint = Path.cwd(), dict(os.environ), signal.getsignal(signal.SIGINT)
    loggers = _handlers()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                cli.main(argv)
                code = 0
            except SystemExit as exc:
                code = int(exc.code or 0)
    finally:
        os.chdir(old)
        # The run sets DS_TRAINER_RUN_STAMP for the processes it starts; left in this process it would send
        # every later test's runs into one run directory.
        os.environ.clear()
        os.environ.update(environ)
        # main() ends by ignoring SIGINT (a process's last moments); every process this worker starts later would
        # inherit that, and Ctrl-C would do nothing to them (CI5: the Slurm Ctrl-C test in the same worker).
        signal.signal(signal.SIGINT, sigint)
        # Hydra's job logging put a file handler on the root logger (<run>/ds_trainer.log): left there, every later
        # test of this worker logged into a folder pytest had deleted with the test's tmp_path, and failed with
        # FileNotFoundError (DeepSpeed's op loader reported the async_io op as incompatible for that).
        _restore(loggers)
    return code, out.getvalue()


def _handlers() -> dict[logging.Logger, list[logging.Handler]]:
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return {log: list(log.handlers) for log in loggers}


def _restore(before: dict[logging.Logger, list[logging.Handler]]) -> None:
    """Each logger's handlers as they were; a handler the run added is closed."""
    for log in [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger))]:
        kept = before.get(log, [])
        for handler in [h for h in log.handlers if h not in kept]:
            log.removeHandler(handler)
            handler.close()
        for handler in kept:
            if handler not in log.handlers:
                log.addHandler(handler)
