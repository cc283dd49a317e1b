"""The config reference, `docs/config.md`, written from the schemas and the option files so it cannot drift.

    python -m ds_trainer.config.docs_reference --write     # rewrite docs/config.md
    python -m ds_trainer.config.docs_reference             # print it

Every key of every group comes from the typed dataclasses of `schema.py` (type, default, and the comment written
above the field there), every option of a group from its YAML files under `conf/` (what each sets). A test
regenerates the page and fails when the committed one differs. Torch-free.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ds_trainer import CONF_DIR
from ds_trainer.config import schema

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
HEADER = """# Config reference

Generated from `ds_trainer/config/schema.py` and `conf/` by `python -m ds_trainer.config.docs_reference --write`; do not
edit by hand (tests/test_docs.py fails when this page and the code disagree). Every key can be set on the command
line (`python -m ds_trainer train.max_steps=20`); a group's option (`python -m ds_trainer zero=stage3`) sets several
at once. A typo or a wrong type fails at composition, with Hydra's own message; values that compose but cannot run
together get the one-screen message of `ds_trainer/config/checks/`.
"""


def _comments(cls: type) -> dict[str, str]:
    """The `# ...` lines written right above each field of a dataclass, joined."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
        elif match := re.match(r"(\w+)\s*:", stripped):
            if pending:
                out[match.group(1)] = " ".join(pending)
            pending = []
        else:
            pending = []
    return out


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(f"`{m.value}`" for m in tp)
    name = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return name if name else re.sub(r"(typing|ds_trainer\.config\.\w+)\.", "", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, list) and all(isinstance(v, enum.Enum) for v in value):
        return "`[" + ", ".join(v.value for v in value) + "]`"
    if dataclasses.is_dataclass(value):
        return "(group)"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def keys() -> list[tuple[str, str, str, str]]:
    """(key, type, default, note) for every leaf key of the composed config's schema, groups first."""
    hints_root = typing.get_type_hints(schema.Config)
    rows: list[tuple[str, str, str, str]] = []
    notes_root = _comments(schema.Config)
    for f in dataclasses.fields(schema.Config):
        tp = hints_root[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            hints, notes = typing.get_type_hints(tp), _comments(tp)
            doc = (inspect.getdoc(tp) or "").split("\n\n")[0].replace("\n", " ")
            for sub in dataclasses.fields(tp):
                note = notes.get(sub.name, "")
                rows.append((f"{f.name}.{sub.name}", _type_name(hints[sub.name]), _default(sub), note))
                block = _optional_block(hints[sub.name])
                if block is not None:  # a block a group's option may set (model.flow): its keys too
                    inner_hints, inner_notes = typing.get_type_hints(block), _comments(block)
                    rows.extend((f"{f.name}.{sub.name}.{leaf.name}", _type_name(inner_hints[leaf.name]),
                                 _default(leaf), inner_notes.get(leaf.name, "")) for leaf in dataclasses.fields(block))
            rows.append((f.name, "(group)", "", doc))
        else:
            rows.append((f.name, _type_name(tp), _default(f), notes_root.get(f.name, "")))
    return rows


def _optional_block(tp: Any) -> type | None:
    """X of a field typed `X | None` where X is a dataclass, else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]) else None


def _flatten(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [item for k, v in node.items() for item in _flatten(v, f"{prefix}{k}.")]
    return [f"{prefix.rstrip('.')}={node}"]


def options(group: str) -> list[tuple[str, str, str]]:
    """(option, what it sets, its first comment line) for each YAML of `conf/<group>/`."""
    out = []
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        data.pop("defaults", None)
        body = data.get(group, data) if isinstance(data, dict) else data
        sets = ", ".join(f"`{s}`" for s in _flatten(body)) if body else "(the schema's defaults)"
        comment = next((line.lstrip("#").strip() for line in text.splitlines()
                        if line.startswith("#") and not line.startswith("# @package")), "")
        out.append((path.stem, sets, comment))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole page."""
    rows = keys()
    lines = [HEADER]
    groups = [key for key, tp, _, _ in rows if tp == "(group)"]
    top = [r for r in rows if "." not in r[0] and r[1] != "(group)"]
    lines += ["## Top-level keys", "", "| key | type | default | note |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {_cell(t)} | {_cell(d)} | {_cell(n)} |" for k, t, d, n in top]
    for group in groups:
        doc = next(n for k, t, _, n in rows if k == group and t == "(group)")
        lines += ["", f"## `{group}`", ""]
        if doc:
            lines += [_cell(doc), ""]
        if (CONF_DIR / group).is_dir():
            lines += ["| option | sets | about |", "|---|---|---|"]
            lines += [f"| `{group}={o}` | {_cell(s)} | {_cell(c)} |" for o, s, c in options(group)]
            lines += [""]
        lines += ["| key | type | default | note |", "|---|---|---|---|"]
        lines += [f"| `{k}` | {_cell(t)} | {_cell(d)} | {_cell(n)} |" for k, t, d, n in rows
                  if k.startswith(f"{group}.")]
    return "\n".join(lines) + "\n"


def generated_page(argv: list[str] | None, module: str, page: Path, make: Callable[[], str], about: str) -> int:
    """The command line of a page generated from the code (`python -m <module> [--write]`): print it, or rewrite
    `page`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=about)
    parser.add_argument("--write", action="store_true", help=f"rewrite {page.relative_to(page.parents[1])}")
    args = parser.parse_args(argv)
    text = make()
    if args.write:
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
        print(f"wrote {page}")
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Print the page, or with `--write` rewrite `docs/config.md`."""
    return generated_page(argv, "ds_trainer.config.docs_reference", PAGE, render, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
