"""The check's command line: `python -m ds_trainer.gpucheck --out DIR [--budget-s S] [--cpu] [--only STEP ...]`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ds_trainer.gpucheck import results, runner
from ds_trainer.gpucheck.steps import GPU_BUDGET_S, Step, sequence

MIN_STEP_S = 5.0  # less left than this: the step is not started
STOP_S = 6.0  # what stopping a step at its timeout may take (runner.GRACE_S, then SIGKILL): kept out of its timeout


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.gpucheck", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md, runs, logs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"wall-clock budget of the whole check (default: {GPU_BUDGET_S} on a GPU, the "
                             "sequence's timeouts summed with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="the same sequence with what a CPU can run (tiny models)")
    parser.add_argument("--only", nargs="+", default=None, metavar="STEP", help="run these steps (in sequence order)")
    parser.add_argument("--timeout", nargs="+", default=[], metavar="STEP=S", help="another timeout for a step")
    parser.add_argument("--list", action="store_true", help="print the sequence with its timeouts and exit")
    return parser.parse_args(argv)


def chosen(args: argparse.Namespace) -> list[Step]:
    """The sequence, filtered by --only, with the --timeout overrides applied."""
    import dataclasses

    steps = sequence(args.cpu)
    names = {s.name for s in steps}
    wanted = set(args.only or names)
    given = dict(item.split("=", 1) for item in args.timeout)
    unknown = (wanted | set(given)) - names
    if unknown:
        raise SystemExit(f"gpucheck: no such step: {', '.join(sorted(unknown))} (steps: {', '.join(sorted(names))})")
    return [dataclasses.replace(s, timeout_s=int(float(given.get(s.name, s.timeout_s)))) for s in steps
            if s.name in wanted]


def _header(args: argparse.Namespace, steps: list[Step], budget: float, start: float) -> dict[str, Any]:
    return {"command": " ".join(["python -m ds_trainer.gpucheck", *sys.argv[1:]]), "cpu": args.cpu,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start)), "budget_s": budget,
            "elapsed_s": 0.0, "done": 0, "total": len(steps), "timeouts_sum_s": sum(s.timeout_s for s in steps),
            "machine": {}}


def check(args: argparse.Namespace) -> int:
    """Run the steps in order within the budget, rewriting the results after each; 1 if a step did not pass."""
    steps = chosen(args)
    budget = float(args.budget_s if args.budget_s is not None else (
        sum(s.timeout_s for s in steps) if args.cpu else GPU_BUDGET_S))
    out: Path = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    header = _header(args, steps, budget, time.time())
    rows: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for step in steps:
        left = budget - (time.monotonic() - start)
        timeout = max(left, step.timeout_s) if step.greedy else step.timeout_s
        timeout = min(timeout, left - STOP_S)  # so that the budget holds when the step is stopped
        row: dict[str, Any]
        if (missing := runner.missing_modules(step)):
            row = {"step": step.name, "group": step.group, "what": step.what, "status": "skipped",
                   "error": f"{', '.join(missing)} not installed (its wheel set: docs/gpu-check.md)"}
        elif left - STOP_S < MIN_STEP_S:
            row = {"step": step.name, "group": step.group, "what": step.what, "status": "skipped",
                   "error": f"budget spent ({max(left, 0):.0f} s left of {budget:.0f} s)"}
        else:
            print(f"gpucheck: {step.name}: {step.what} (timeout {timeout:.0f} s)", file=sys.stderr, flush=True)
            row = runner.run_step(step, out, timeout)
        if step.name == "machine" and row.get("data"):
            header["machine"] = row["data"]
        if step.real and row.get("status") == "ok":
            row["mfu"] = results.mfu(row, step, header["machine"])
            if (record := results.calibration_record(row, step, header["machine"])) is not None:
                records.append(record)
        rows.append(row)
        header.update(elapsed_s=round(time.monotonic() - start, 1), done=len(rows))
        results.write(out, header, rows, records)
        said = row.get("error") or row.get("note") or ""
        print(f"gpucheck: {step.name}: {row['status']} {said}"[:400], file=sys.stderr, flush=True)
    print(f"gpucheck: results in {out / 'results.md'}", file=sys.stderr)
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        steps = chosen(args)
        for s in steps:
            print(f"{s.name:22} {s.group:12} {s.timeout_s:4d} s{' (+ what is left)' if s.greedy else ''}  {s.what}")
        print(f"{'total':35} {sum(s.timeout_s for s in steps):4d} s")
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
