"""Reads a W&B offline run file (`run-*.wandb`): W&B 0.31 ships no Python reader for it.

The file is a 7-byte header (":W&B", magic 0xBEE1, version) followed by a LevelDB-style log: 32 KiB
blocks of records, each with a 7-byte header (CRC32C, length, type: FULL=1, FIRST=2, MIDDLE=3,
LAST=4) whose payloads are `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a record header is padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def history(path: Path) -> list[dict[str, Any]]:
    """The logged rows: {"_step": step, key: value, ...} per history record."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or ".".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def config(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                out[item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_info(path: Path) -> Any:
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run
    return None


def rewound_history(paths: list[Path]) -> list[dict[str, Any]]:
    """The history W&B shows for a run written by several processes (oldest file first): a file whose
    run record has a branch point (`resume_from="<id>?_step=N"`) rewinds what came before to step N."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        point = run_info(path).branch_point
        if point.run:
            rows = [r for r in rows if r["_step"] <= point.value]
        rows += history(path)
    return rows
