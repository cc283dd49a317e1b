"""`python -m ds_trainer.gpucheck.rehearse`: the GPU check's device calls, rehearsed here.

Each call runs the exact command docs/gpu-check.md gives the device tool (`COMMAND`) the way the
tool runs it: in a copy of what it sends (the files git tracks and those it does not ignore, and
the carried wheel sets), with $OUT an empty folder, under the same limits, and fails when one is
broken:

- the working tree with the carried paths: at most 64 MiB;
- one command: 600 s of wall clock, install included (stopped at the limit, as the tool does);
- what comes back from $OUT: at most 8 files of 16 MiB, 64 MiB together, no deeper than two
  folders, named in letters, digits, '.', '_' and '-'; and results.json among them.

Here there is no GPU: the wrapper runs the check's CPU form (GPUCHECK_CPU=1) with this Python
(PYTHON), and "the machine's" folders (the installed wheels, the ledger the second call continues
from) are a temporary folder (GPUCHECK_BASE). `--parts 1 2` makes both calls in turn on it, as on
a warm machine. On a Python other than 3.12 a cp312 wheel cannot load, so it is stood in by this
Python's own installation of the same pinned version, repacked (said in the report). Without a
wheelhouse (`--standin`, or none built) a one-file wheel stands in for the sets, so that the
install runs; the default test suite rehearses so (tests/test_gpucheck.py).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
COMMAND = "bash ds_trainer/gpucheck/run_on_gpu.sh $OUT --part {part}"
CARRY = (".wheelhouse/core", ".wheelhouse/bnb")
LIMIT_S = 600
TREE_MIB = 64
FILES, FILE_MIB, FILES_MIB, DEPTH = 8, 16, 64, 2
NAME = re.compile(r"^[A-Za-z0-9._-]+$")
MIB = 2**20
# The short form (`--short`, the default test suite's): both calls, each cut to a few steps on a
# small budget: call 1 the machine step with a timeout it cannot meet, a resume whose source did
# not run (it fails) and the wait for FusedAdam's background build, call 2 a real-size cell in its
# CPU form (it measures, after its op's build) and the Flux step on what is left.
SHORT = ["--budget-s", "75", "--only", "machine", "tiny_fsdp_cpu_resume", "ops_fused_adam",
         "sdxl_zero2", "flux_dev_lora", "--timeout", "machine=3"]


@dataclass
class Call:
    """One rehearsed device call: what it sent, how long it ran, what came back, what broke."""

    part: int
    command: str
    seconds: float = 0.0
    rc: int | None = None
    returned: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def sent_files(repo: Path) -> list[str]:
    """What the tool sends of the checkout: the files git tracks and those it does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                            capture_output=True, check=True).stdout.decode()
    return [name for name in listed.split("\0") if name and (repo / name).is_file()]


def size_of(paths: list[Path]) -> int:
    return sum(p.stat().st_size for path in paths
               for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())


def copy_tree(repo: Path, dest: Path, carry: tuple[str, ...]) -> tuple[int, int]:
    """Copy what the tool sends into `dest`; the bytes of the tree and of the carried paths."""
    names = sent_files(repo)
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, dest / name)
    for path in carry:
        shutil.copytree(repo / path, dest / path)
    return size_of([repo / n for n in names]), size_of([repo / p for p in carry])


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def write_wheel(path: Path, files: dict[str, bytes], dist_info: str, tag: str) -> Path:
    """A wheel holding `files` (archive name -> bytes), with its WHEEL and RECORD."""
    files = {**files, f"{dist_info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: ds_trainer\n"
                                             f"Root-Is-Purelib: false\nTag: {tag}\n").encode()}
    record = "".join(_record_line(n, d) for n, d in files.items()) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{dist_info}/RECORD", record)
    return path


def standin_wheel(folder: Path) -> Path:
    """A one-module wheel standing in for the wheel sets where none is built (CI)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = "gpucheck_standin-1.0.dist-info"
    meta = b"Metadata-Version: 2.1\nName: gpucheck-standin\nVersion: 1.0\n"
    return write_wheel(folder / "gpucheck_standin-1.0-py3-none-any.whl",
                       {"gpucheck_standin.py": b"CARRIED = True\n", f"{info}/METADATA": meta},
                       info, "py3-none-any")


def substitute_foreign(wheelhouse: Path) -> list[str]:
    """Replace each cp312 wheel by this Python's installation of the same version, repacked."""
    mine = f"cp{sys.version_info.major}{sys.version_info.minor}"
    said = []
    for wheel in sorted(wheelhouse.glob("*/*-cp312-*.whl")):
        if mine == "cp312":
            break
        name, version = wheel.name.split("-")[:2]
        dist = metadata.distribution(name)
        if dist.version != version:
            raise SystemExit(f"rehearse: {wheel.name} cannot load on this Python and its "
                             f"{name} is {dist.version}, not the pinned {version}")
        files = {str(f): Path(str(dist.locate_file(f))).read_bytes() for f in dist.files or []
                 if "__pycache__" not in str(f) and not str(f).endswith(("RECORD", "WHEEL"))}
        info = next(str(f).split("/")[0] for f in dist.files or [] if ".dist-info/" in str(f))
        write_wheel(wheel.with_name(f"{name}-{version}-{mine}-{mine}-linux_x86_64.whl"), files,
                    info, f"{mine}-{mine}-linux_x86_64")
        wheel.unlink()
        said.append(f"{wheel.name} stood in by this Python's own {name} {version} ({mine})")
    return said


def run(command: str, cwd: Path, env: dict[str, str], limit: float) -> tuple[int | None, float]:
    """Run `command` with bash under a wall clock, stopped at `limit` with everything it started
    (the tool's kill); its exit status (None when stopped) and seconds."""
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, start_new_session=True)
    try:
        rc: int | None = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    return rc, round(time.monotonic() - start, 1)


def returned(out: Path) -> tuple[dict[str, int], list[str]]:
    """What the tool would bring back from $OUT, and each of its limits that is broken."""
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*"))
             if p.is_file()}
    problems = []
    if len(files) > FILES:
        problems.append(f"$OUT holds {len(files)} files: {FILES} come back")
    for name, size in files.items():
        if size > FILE_MIB * MIB:
            problems.append(f"$OUT/{name} is {size / MIB:.1f} MiB: over {FILE_MIB} MiB")
        if len(Path(name).parts) > DEPTH + 1:
            problems.append(f"$OUT/{name} is more than {DEPTH} folders down")
        if not all(NAME.match(part) for part in Path(name).parts):
            problems.append(f"$OUT/{name}: only letters, digits, '.', '_' and '-' come back")
    if sum(files.values()) > FILES_MIB * MIB:
        problems.append(f"$OUT holds {sum(files.values()) / MIB:.1f} MiB: {FILES_MIB} come back")
    if "results.json" not in files:
        problems.append("no results.json came back")
    return files, problems


def tree_problems(tree: int, carried: int) -> list[str]:
    """The working tree and the carried paths (bytes) against the tool's limit."""
    if tree + carried <= TREE_MIB * MIB:
        return []
    return [f"the tree ({tree / MIB:.1f} MiB) and the carried wheels ({carried / MIB:.1f} MiB) "
            f"are over {TREE_MIB} MiB"]


def command(part: int, extra: list[str]) -> str:
    """The device call's command: docs/gpu-check.md's, and the check options given after it."""
    return " ".join([COMMAND.format(part=part), *map(shlex.quote, extra)])


def rehearse(parts: list[int], extra: list[str], root: Path, standin: bool = False,
             limit: float = LIMIT_S) -> dict[str, Any]:
    """Send a copy of the checkout to `root`/repo and make each call on it in turn, against one
    "machine" folder; the report (every problem under `problems`)."""
    carry = () if standin or not all((REPO / p).is_dir() for p in CARRY) else CARRY
    tree, carried = copy_tree(REPO, root / "repo", carry)
    if not carry:
        standin_wheel(root / "repo" / ".wheelhouse" / "standin")
    notes = substitute_foreign(root / "repo" / ".wheelhouse")
    problems, calls = tree_problems(tree, carried), []
    for part in parts:
        out = root / f"out{part}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        call = Call(part, command(part, extra))
        env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
               "GPUCHECK_BASE": str(root / "machine"), "GPUCHECK_CPU": "1"}
        call.rc, call.seconds = run(call.command, root / "repo", env, limit)
        call.returned, call.problems = returned(out)
        if call.rc is None:
            call.problems.insert(0, f"the command ran past {limit:.0f} s and was stopped")
        calls.append(call)
        problems += [f"call {part}: {p}" for p in call.problems]
    return {"root": str(root), "tree_mib": round(tree / MIB, 2),
            "carried_mib": round(carried / MIB, 2), "carried": list(carry) or ["a stand-in wheel"],
            "notes": notes, "calls": [vars(c) for c in calls], "problems": problems}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.gpucheck.rehearse",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", type=int, default=[1, 2], help="the calls to make")
    parser.add_argument("--standin", action="store_true",
                        help="a one-file wheel instead of the wheel sets")
    parser.add_argument("--short", action="store_true",
                        help=f"the short form: --standin -- {' '.join(SHORT)}")
    parser.add_argument("--keep", type=Path, default=None, help="the folder to rehearse in")
    parser.add_argument("--limit-s", type=float, default=LIMIT_S, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="-- then check options added to each call's command")
    args = parser.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    extra = SHORT + extra if args.short else extra
    root = args.keep or Path(tempfile.mkdtemp(prefix="gpucheck-rehearsal-"))
    root.mkdir(parents=True, exist_ok=True)
    report = rehearse(args.parts, extra, root, args.standin or args.short, args.limit_s)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"tree {report['tree_mib']} MiB + carried {report['carried_mib']} MiB "
              f"({', '.join(report['carried'])}) of {TREE_MIB} MiB; {'; '.join(report['notes'])}")
        for call in report["calls"]:
            back = ", ".join(f"{n} {s / MIB:.2f} MiB" for n, s in call["returned"].items())
            print(f"call {call['part']}: `{call['command']}` ran {call['seconds']} s of {LIMIT_S}"
                  f" (exit {call['rc']}); back: {back}")
        print("\n".join(f"BROKEN: {p}" for p in report["problems"]) or "every limit held")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
