"""The planner's slow parts remembered on disk between runs (~/.cache/ds_trainer/plan.json). Torch-free."""

from __future__ import annotations

from typing import Any


def cached(kind: str, args: tuple[Any, ...], compute: Any) -> Any:
    """`compute(*args)` remembered on disk (~/.cache/ds_trainer/plan.json): the meta-device forward costs
    seconds at every start of training, and its inputs rarely change. The key holds the UNet config's
    text, diffusers' version and the planner's text, so a change of any recomputes."""
    import hashlib
    import importlib.metadata
    import json
    import os
    from pathlib import Path

    config = Path(str(args[0])) / "unet" / "config.json"
    planner = (Path(__file__).parent / "plan.py").read_text()
    key = hashlib.sha256(json.dumps([kind, [str(a) for a in args], config.read_text() if config.is_file() else "",
                                     importlib.metadata.version("diffusers"), planner]).encode()).hexdigest()
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds_trainer" / "plan.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    value = compute(*args)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: value}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: compute again next time
    return value
