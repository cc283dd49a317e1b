"""Every refusal, `docs/refusals.md`, written from the rules themselves so it cannot drift.

    python -m ds_trainer.config.refusals --write     # rewrite docs/refusals.md
    python -m ds_trainer.config.refusals             # print it

Each `Problem(...)` that a rule module returns is one refusal: the page lists it under its module with the
conditions that lead to it (the `if` tests around it, the loop it is in, the function's first docstring line), the
key it names, why, and the fix, as the code writes them (`{...}` where the message puts a value in). The rule
modules are the ones `checks.check` runs and the run's own checks before its first step (a resume from another
layout, a LoRA that matches no module, the weights file); a typo in an override (`overrides.py`) is not a
combination and is not listed. A test regenerates the page and fails when the committed one differs. Torch-free:
the modules are read as source, not imported.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from ds_trainer.config import docs_reference, families

PACKAGE = Path(__file__).resolve().parents[1]
PAGE = PACKAGE.parent / "docs" / "refusals.md"
# The rule modules, in the order a check runs them (checks/__init__.py), then the run's own checks.
MODULES = ("config/checks/settings.py", "config/checks/model.py", "config/families/wan.py",
           "config/checks/video.py", "config/buckets.py", "config/checks/precision.py",
           "config/checks/backend.py", "config/checks/optimizer.py", "config/checks/parallel.py",
           "config/checks/swap.py",
           "config/checks/paths.py", "config/checks/adapter.py", "config/samples.py", "config/holdout.py",
           "config/checks/ops.py", "config/weights_file.py", "config/portability.py", "train/adapters/adapter.py",
           "train/adapters/lora_file.py")
HEADER = """# Every refusal

Generated from the rules by `python -m ds_trainer.config.refusals --write`; do not edit by hand (tests/test_docs.py
fails when this page and the code disagree). A combination that cannot train is refused before its first step,
with a one-screen message naming each problem's key, its value, why, and the fix, and exit status 2; nothing is
swapped silently. Most refusals come already from a dry run (`dry_run=true`: the torch-free checks of
`ds_trainer/config/`); the last sections are the run's own checks once the models load (a resume from another
layout, a LoRA's target modules, a weights file). Under torchrun the ranks of a machine print the message once
(its first local rank), and torchrun then adds its own failure block (its exit status is 1, the block names the
rank's `exitcode: 2`); to see a multi-rank refusal without launching, add `world_size=<ranks> dry_run=true`.

Each entry: **the key** the message names, *when* (the conditions around the rule in the code, as written there),
then why and the fix as the message says them, `{...}` standing for a value the message fills in.
"""


@dataclass
class Refusal:
    """One `Problem(...)` in a rule module."""

    function: str
    summary: str  # the first line of the function's docstring
    key: str
    when: list[str]
    why: str
    fix: str


def text_of(node: ast.expr, assigned: dict[str, list[ast.expr]] | None = None) -> str:
    """A message as the code writes it: literals as they are, a formatted value as `{its expression}`, a string
    concatenation joined, a local variable as what the function assigns it (each assignment, joined by " / ");
    anything else as `{expression}`."""
    assigned = assigned or {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(text_of(v, assigned) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        return "{" + ast.unparse(node.value) + "}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return text_of(node.left, assigned) + text_of(node.right, assigned)
    if isinstance(node, ast.Name) and node.id in assigned:
        return " / ".join(text_of(v, {k: a for k, a in assigned.items() if k != node.id}) for v in assigned[node.id])
    return "{" + ast.unparse(node) + "}"


def _assignments(function: ast.FunctionDef) -> dict[str, list[ast.expr]]:
    """What the function assigns to each plain local name (`why = ...`), in source order."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out.setdefault(node.targets[0].id, []).append(node.value)
    return out


def _conditions(path: list[ast.AST], call: ast.AST) -> list[str]:
    """The `if` tests (negated in an else branch), loops and comprehensions on the way from the function to
    `call`."""
    out: list[str] = []
    chain = [*path, call]
    for parent, child in zip(chain, chain[1:], strict=False):
        if isinstance(parent, ast.If | ast.IfExp):
            test = ast.unparse(parent.test)
            orelse = parent.orelse if isinstance(parent, ast.If) else [parent.orelse]
            if parent.test is not child:
                out.append(f"not ({test})" if any(child is n for n in orelse) else test)
        elif isinstance(parent, ast.For):
            out.append(f"for {ast.unparse(parent.target)} in {ast.unparse(parent.iter)}")
        elif isinstance(parent, ast.comprehension):
            out += [f"for {ast.unparse(parent.target)} in {ast.unparse(parent.iter)}",
                    *(ast.unparse(i) for i in parent.ifs)]
    return out


def _walk(node: ast.AST, path: list[ast.AST]) -> list[tuple[list[ast.AST], ast.Call]]:
    """Every `Problem(...)` call under `node`, with the nodes on the way to it."""
    found: list[tuple[list[ast.AST], ast.Call]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Call) and getattr(child.func, "id", None) == "Problem" and len(child.args) >= 4:
            found.append((path + [node], child))
        found += _walk(child, path + [node])
    return found


def _argument(call: ast.Call, index: int, name: str) -> ast.expr:
    named = {k.arg: k.value for k in call.keywords}
    return named[name] if name in named else call.args[index]


def refusals(module: str) -> list[Refusal]:
    """The refusals of one rule module (a path under the package), in source order."""
    tree = ast.parse((PACKAGE / module).read_text())
    out = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        doc = (ast.get_docstring(function) or "").split("\n\n")[0].replace("\n", " ")
        assigned = _assignments(function)
        for path, call in _walk(function, []):
            inner = [n for n in path if isinstance(n, ast.FunctionDef)]
            if inner[-1] is not function:
                continue  # a nested function's own
            out.append(Refusal(function.name, doc, text_of(_argument(call, 0, "key")), _conditions(path[1:], call),
                               text_of(_argument(call, 2, "why"), assigned),
                               text_of(_argument(call, 3, "fix"), assigned)))
    return out


def _entry(r: Refusal) -> list[str]:
    when = " and ".join(f"`{c}`" for c in r.when) if r.when else "always, once the function is reached"
    return [f"- **`{r.key}`** (`{r.function}`), when {when}", f"  - why: {r.why}", f"  - fix: {r.fix}"]


def render() -> str:
    """The page: one section per rule module, each function's summary before its refusals."""
    lines = [HEADER.rstrip("\n")]
    total = 0
    for module in MODULES:
        found = refusals(module)
        total += len(found)
        lines += ["", f"## `ds_trainer/{module}` ({len(found)})"]
        last = None
        for r in found:
            if r.function != last and r.summary:
                lines += ["", f"`{r.function}`: {r.summary}", ""]
            elif r.function != last:
                lines += [""]
            last = r.function
            lines += _entry(r)
    lines += _family_facts()
    lines += ["", f"{total} refusals in {len(MODULES)} modules."]
    return "\n".join(lines) + "\n"


def _family_facts() -> list[str]:
    """What the rules above read from each family's spec (config/families/), named where a rule says `{spec...}`."""
    lines = ["", "## The families' facts the rules read (`ds_trainer/config/families/`)", ""]
    for s in families.SPECS.values():
        facts = [f"trains {'by flow matching' if s.flow else 'on DDPM noise'}",
                 f"text encoders {', '.join(s.text_encoders)}"]
        if s.caption_limit is not None:
            facts.append(f"at most {s.caption_limit} caption tokens ({s.pipeline})")
        if s.guidance_input:
            facts.append("a distilled guidance input")
        if s.dynamic_shift:
            facts.append("the resolution-dependent shift")
        if s.transformer_file is not None:
            facts.append(f"model.transformer reads {s.transformer_file.label}")
        if s.fp16:
            facts.append(f"fp16 refused: {s.fp16}")
        lines.append(f"- **{s.name}** ({s.label}): " + "; ".join(facts))
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the page, or with `--write` rewrite `docs/refusals.md`."""
    return docs_reference.generated_page(argv, "ds_trainer.config.refusals", PAGE, render, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
