"""The check's command line:
`python -m ds_trainer.gpucheck --out DIR [--part N] [--mirror DIR] [--budget-s S] [--cpu] ...`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from ds_trainer.gpucheck import builds, ledger, results, runner
from ds_trainer.gpucheck.steps import (
    BUILDERS,
    GPU_BUDGET_S,
    PART_BUDGET_S,
    Step,
    loads,
    sequence,
)

MIN_STEP_S = 5.0  # less left than this: the step is not started
# What stopping a step at its timeout may take (SIGTERM, runner.GRACE_S, then SIGKILL and its
# wait): kept out of its timeout, so that the budget holds when a step is stopped.
STOP_S = runner.GRACE_S + runner.KILL_WAIT_S


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.gpucheck", description=__doc__)
    add = parser.add_argument
    add("--out", type=Path, required=True, help="work folder: runs, logs, results (fresh per call)")
    add("--part", type=int, choices=sorted(PART_BUDGET_S), default=None,
        help="one device call's share of the sequence; part 2 first runs what part 1 left unrun "
             "(read from --state)")
    add("--state", type=Path, default=None,
        help="what earlier calls ran (rewritten after every step; --part 1 starts it afresh)")
    add("--mirror", type=Path, default=None,
        help="a folder that gets results.json, results.md, plan_calibration.jsonl and logs.tgz "
             "after every step (the device tool's $OUT)")
    add("--budget-s", type=float, default=None,
        help=f"wall-clock budget of this call (default: the part's {PART_BUDGET_S}, "
             f"{GPU_BUDGET_S} for the whole sequence; with --cpu the timeouts summed)")
    add("--deadline", type=float, default=None,
        help="a time (seconds since the epoch) by which the check must have ended: the budget is "
             "cut to it (run_on_gpu.sh: its own start + 600 s, less the stop and the transfers)")
    add("--cpu", action="store_true", help="the same sequence with what a CPU can run")
    add("--only", nargs="+", default=None, metavar="STEP", help="run these steps (in order)")
    add("--timeout", nargs="+", default=[], metavar="STEP=S", help="another timeout for a step")
    add("--list", action="store_true", help="print the sequence with its timeouts and exit")
    return parser.parse_args(argv)


def chosen(args: argparse.Namespace, done: set[str] | None = None) -> list[Step]:
    """The sequence, cut to the part (with an earlier part's steps not yet done) and to --only,
    with the --timeout overrides applied."""
    steps, done = sequence(args.cpu), done or set()
    names = {s.name for s in steps}
    given = dict(item.split("=", 1) for item in args.timeout)
    unknown = (set(args.only or ()) | set(given)) - names
    if unknown:
        raise SystemExit(f"gpucheck: no such step: {', '.join(sorted(unknown))} "
                         f"(steps: {', '.join(sorted(names))})")
    if args.part is not None:
        steps = [s for s in steps if s.part <= args.part and s.name not in done]
    if args.only:
        steps = [s for s in steps if s.name in args.only]
    return [dataclasses.replace(s, timeout_s=int(float(given.get(s.name, s.timeout_s))))
            for s in steps]


def budget_of(args: argparse.Namespace, steps: list[Step]) -> float:
    """This call's budget: --budget-s, else the part's, else the whole sequence's (with --cpu its
    timeouts summed), cut to --deadline."""
    if args.budget_s is not None:
        budget = float(args.budget_s)
    elif args.part is not None:  # the CPU form too: the rehearsal holds a call to the same time
        budget = float(PART_BUDGET_S[args.part])
    elif args.cpu:
        budget = float(sum(s.timeout_s for s in steps))
    else:
        budget = float(GPU_BUDGET_S)
    if args.deadline is not None:
        budget = min(budget, args.deadline - time.time())
    return budget


def _header(args: argparse.Namespace, steps: list[Step], budget: float) -> dict[str, Any]:
    return {"command": " ".join(["python -m ds_trainer.gpucheck", *sys.argv[1:]]),
            "cpu": args.cpu, "part": args.part,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "budget_s": round(budget, 1), "elapsed_s": 0.0, "done": 0, "total": len(steps),
            "timeouts_sum_s": sum(s.timeout_s for s in steps), "machine": {}}


def _skipped(step: Step, why: str) -> dict[str, Any]:
    return {"step": step.name, "group": step.group, "what": step.what, "status": "skipped",
            "error": why}


def run_one(step: Step, out: Path, left: float, book: ledger.Ledger,  # noqa: PLR0913
            started: dict[str, builds.Build], cpu: bool) -> dict[str, Any]:
    """One step's row: skipped (a package missing, the budget spent, its op not built), or run
    within its timeout (never past what is left of the budget, the stop kept out)."""
    timeout = max(left, step.timeout_s) if step.greedy else step.timeout_s
    timeout = min(timeout, left - STOP_S)
    if (missing := runner.missing_modules(step)):
        return _skipped(step, f"{', '.join(missing)} not installed (docs/gpu-check.md)")
    if left - STOP_S < MIN_STEP_S:
        return _skipped(step, f"budget spent ({max(left, 0):.0f} s left)")
    if step.kind == "build":
        return runner.build_row(step, started.get(step.args[0]), timeout)
    begin = time.monotonic()
    for op in loads(step, cpu):  # wait for the op's build (inside the step's time), or skip
        build = started.get(op)
        if build is not None and build.wait(begin + timeout) != "ok":
            how = build.status or f"still building after {build.seconds():.0f} s"
            return _skipped(step, f"DeepSpeed's {op} was not built ({how}: {build.said()})")
    timeout -= time.monotonic() - begin
    print(f"gpucheck: {step.name}: {step.what} (timeout {timeout:.0f} s)", file=sys.stderr,
          flush=True)
    return runner.run_step(step, out, timeout, book.runs)


def check(args: argparse.Namespace) -> int:
    """Run the steps in order within the budget, rewriting the results (and their mirror) after
    each; 1 if a step did not pass."""
    out: Path = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    book = ledger.Ledger.read(args.state, fresh=args.part in (None, 1))
    steps = chosen(args, book.done())
    budget, start = budget_of(args, steps), time.monotonic()
    header = _header(args, steps, budget)
    header["machine"] = dict(book.machine)
    wanted = {op for s in steps for op in loads(s, args.cpu)}
    wanted |= {s.args[0] for s in steps if s.kind == "build"}
    ops = [op for op in BUILDERS if op in wanted]
    if args.only:  # steps picked by hand load their ops themselves, unless a build step is picked
        ops = [op for op in ops if f"ops_{op}" in args.only]
    started = builds.start(ops, out / "logs", args.cpu)
    rows: list[dict[str, Any]] = []
    try:
        for step in steps:
            row = run_one(step, out, budget - (time.monotonic() - start), book, started,
                          args.cpu)
            if step.name == "machine" and row.get("data"):
                header["machine"] = book.machine = row["data"]
            if step.real and row.get("status") == "ok":
                row["mfu"] = results.mfu(row, step, header["machine"])
            rows.append(row)
            book.add(row, out / "runs" / step.name)
            header.update(elapsed_s=round(time.monotonic() - start, 1), done=len(rows))
            _write(out, args.mirror, header, book)
            said = row.get("error") or row.get("note") or ""
            print(f"gpucheck: {step.name}: {row['status']} {said}"[:400], file=sys.stderr,
                  flush=True)
    finally:
        builds.stop_all(started)
    _write(out, args.mirror, header, book)
    print(f"gpucheck: results in {out / 'results.md'}", file=sys.stderr)
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


def _write(out: Path, mirror: Path | None, header: dict[str, Any], book: ledger.Ledger) -> None:
    """The results of every call so far (earlier calls' rows first), and the state file."""
    every = {s.name: s for s in sequence(bool(header["cpu"]))}
    rows = book.rows_in(list(every))
    measured = [(row, every[row["step"]]) for row in rows if every[row["step"]].real]
    records = [r for row, step in measured
               if (r := results.calibration_record(row, step, header["machine"])) is not None]
    results.write(out, header, rows, records)
    if mirror is not None:
        results.mirror(out, mirror)
    book.write()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        for s in chosen(args):
            more = " (+ what is left)" if s.greedy else ""
            print(f"{s.name:22} part {s.part} {s.group:12} {s.timeout_s:4d} s{more}  {s.what}")
        for part, budget in PART_BUDGET_S.items():
            total = sum(s.timeout_s for s in chosen(args) if s.part == part)
            print(f"part {part}: timeouts {total} s of a {budget} s budget")
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
