"""The planner's slow parts remembered on disk between runs (~/.cache/ds_trainer/plan.json). Torch-free."""

from __future__ import annotations

from typing import Any


def cached(kind: str, args: tuple[Any, ...], compute: Any) -> Any:
    """`compute(*args)` remembered on disk (~/.cache/ds_trainer/plan.json): the meta-device forward costs
    seconds at every start of training, and its inputs rarely change. The key holds the UNet's (or transformer's)
    config text, diffusers' version and the planner's text (cells.py, unet.py), so a change of any recomputes."""
    import hashlib
    import importlib.metadata
    import json
    import os
    from pathlib import Path

    folder = Path(str(args[0]))
    config = folder / "unet" / "config.json"
    if not config.is_file():  # a diffusion transformer's (SD3, Flux)
        config = folder / "transformer" / "config.json"
    planner = "".join((Path(__file__).parent / name).read_text() for name in ("cells.py", "unet.py"))
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
