"""The planner's slow parts remembered on disk between runs (~/.cache/ds_trainer/plan.json). Torch-free."""

from __future__ import annotations

from typing import Any


def cached(kind: str, args: tuple[Any, ...], compute: Any) -> Any:
    """`compute(*args)` remembered on disk (~/.cache/ds_trainer/plan.json): the meta-device forward costs
    seconds at every start of training, and its inputs rarely change. The key holds the UNet's (or transformer's)
    config text, diffusers' version and the planner's text (cells.py, unet.py, the family's module
    that builds the forward), so a change of any recomputes."""
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
    planner += _family_text(config)
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


def _family_text(config: Any) -> str:
    """The text of the module of the family whose trained module `config` (its config.json)
    describes: its `planner_forward` builds the forward measured (train/families/<family>.py)."""
    import json
    from pathlib import Path

    from ds_trainer.config import families

    try:
        name = str(json.loads(config.read_text()).get("_class_name", ""))
    except (OSError, ValueError):
        return ""
    module = families.of_classes([name]).implementation.partition(":")[0]
    path = Path(__file__).parents[2].joinpath(*module.split(".")[1:]).with_suffix(".py")
    return path.read_text() if path.is_file() else ""
