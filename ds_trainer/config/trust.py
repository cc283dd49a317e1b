"""Which checkpoints may be unpickled: DeepSpeed's and Accelerate's native files are pickles, and
unpickling one runs whatever it names. ds_trainer's own state (the portable state, the EMA, the
scheduler) is safetensors, JSON or `torch.load(weights_only=True)` and is safe from anyone.

A checkpoint this user's runs wrote carries, in its `COMPLETE` marker, an HMAC-SHA256 of the marker
(the trainer state and every file's size and content hash) under a key only this user can read
(`$DS_TRAINER_KEY`, else `$XDG_CONFIG_HOME/ds_trainer/checkpoint.key`, made on the first save, mode
0600). A resume checks the files against those hashes first (`checkpoint.damaged`), so a verified
signature says: written by this user's runs and unchanged since. Only then is the native, bit-exact
load used; any other checkpoint resumes through its portable state, or with
`resume_trust_native=true`, natively after all. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

log = logging.getLogger("ds_trainer")

FIELD = "signature"


def key_path() -> Path:
    named = os.environ.get("DS_TRAINER_KEY")
    if named:
        return Path(named)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "ds_trainer" / "checkpoint.key"


def _key(create: bool) -> bytes | None:
    """This user's signing key; made (readable by the user alone) if `create` and there is none."""
    path = key_path()
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        if not create:
            return None
    except (OSError, ValueError) as exc:
        log.warning("the checkpoint key %s cannot be read (%s): checkpoints resume through "
                    "their portable state", path, exc)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    except FileExistsError:  # another rank or run made it first
        pass
    except OSError as exc:
        log.warning("no checkpoint key can be made at %s (%s): this run's checkpoints resume "
                    "through their portable state (set DS_TRAINER_KEY to a writable path)",
                    path, exc)
        return None
    return _key(create=False)


def _digest(key: bytes, state: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in state.items() if k != FIELD}, sort_keys=True, default=str)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def signed(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a marker's content) with this user's signature, or as it is without a key."""
    key = _key(create=True)
    return state if key is None else {**state, FIELD: _digest(key, state)}


def trusted(state: dict[str, Any]) -> bool:
    """Whether a marker's content carries this user's signature (its files are checked apart)."""
    key, given = _key(create=False), state.get(FIELD)
    if key is None or not isinstance(given, str):
        return False
    return hmac.compare_digest(given, _digest(key, state))


def native_allowed(cfg: DictConfig, checkpoint: Path | None) -> bool:
    """Whether a resume from `checkpoint` may load DeepSpeed's and Accelerate's native files:
    this user's signature on its marker, or `resume_trust_native=true`."""
    if checkpoint is None or bool(cfg.get("resume_trust_native")):
        return True
    try:
        state = json.loads((Path(checkpoint) / "COMPLETE").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and trusted(state)


def untrusted_why(checkpoint: Path) -> str:
    return (f"the checkpoint {checkpoint} was not written by this user's runs (its COMPLETE "
            f"marker carries no signature of the key {key_path()}, or its files changed "
            "since), and its DeepSpeed and Accelerate files are pickles, which can run code")
