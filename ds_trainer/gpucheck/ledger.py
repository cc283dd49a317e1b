"""What the check's earlier calls on this machine ran, so that the next one continues (`--state`).

A device call has ten minutes, so the sequence runs in two (`--part 1`, `--part 2`) on the same
warm machine. The ledger, rewritten after every step, holds each step's row, the run folder a
later step resumes from, and the machine's row; `--part 2` runs what part 1 left unrun (the budget
spent, or the call stopped) before its own steps, and writes the results of both. `--part 1`
starts a fresh one. Each call trains in a fresh work folder (a rerun never continues from an
earlier run's checkpoints); the ledger only says where the earlier runs are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Ledger:
    path: Path | None
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: dict[str, Path] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    call: int = 1

    @classmethod
    def read(cls, path: Path | None, fresh: bool) -> Ledger:
        """The earlier calls' ledger (none when `fresh`, or when there is none yet)."""
        if path is None or fresh or not path.exists():
            return cls(path)
        held = json.loads(path.read_text())
        return cls(path, dict(held["rows"]), {k: Path(v) for k, v in held["runs"].items()},
                   dict(held["machine"]), int(held["call"]) + 1)

    def done(self) -> set[str]:
        """The steps an earlier call ran to an end (a skip for want of time or of a built op is
        not one; a package missing is)."""
        return {name for name, row in self.rows.items()
                if row["status"] != "skipped" or "not installed" in str(row.get("error"))}

    def add(self, row: dict[str, Any], run: Path) -> None:
        row["call"] = self.call
        self.rows[row["step"]] = row
        if run.is_dir():
            self.runs[row["step"]] = run

    def rows_in(self, order: list[str]) -> list[dict[str, Any]]:
        """Every call's rows, in the sequence's order."""
        return [self.rows[name] for name in order if name in self.rows]

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"call": self.call, "rows": self.rows, "machine": self.machine,
                                   "runs": {k: str(v) for k, v in self.runs.items()}},
                                  default=str))
        os.replace(tmp, self.path)
