"""The shape of the code, held by tests (STYLE.md made executable): the layers of a run and no import circle
(import-linter's contracts in pyproject.toml, and grimp's graph), no function over 60 lines, no code outside
`train/backends/` asking which backend runs, no use of another module's private names, and docs/architecture.md
naming every module. Each fails with the places that break the rule."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_trainer"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts)


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def test_imports_point_down_the_layers_of_a_run() -> None:
    import logging

    from importlinter import cli

    # import-linter configures logging with dictConfig, which disables every logger that exists (DeepSpeed's,
    # diffusers', ours): later tests of this worker would see none of their messages
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]
    enabled = [logger for logger in loggers if not logger.disabled]
    try:
        assert cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0, \
            "an import points up a layer (the contracts' report above names it)"
    finally:
        for logger in enabled:
            logger.disabled = False


def test_no_two_modules_import_each_other_through_any_chain() -> None:
    import grimp

    graph = grimp.build_graph("ds_trainer", exclude_type_checking_imports=True, cache_dir=None)
    imports = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    circles = [sorted(group) for group in _strongly_connected(imports) if len(group) > 1]
    assert circles == [], f"import circles: {circles}"


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (the graph has a few hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                found.append(group)
    return found


def test_the_strongly_connected_search_finds_a_circle() -> None:
    """The circle check can fail: a planted circle a -> b -> c -> a is found, a chain is not."""
    circles = [g for g in _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) if len(g) > 1]
    assert [sorted(g) for g in circles] == [["a", "b", "c"]]
    assert all(len(g) == 1 for g in _strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}))


def test_no_module_is_over_450_lines() -> None:
    """Issue 60's bound: a module past it is two modules (train/data/sources.py was 537: its table and
    archive readers are tables.py and archives.py now)."""
    long = {_name(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}, long


def test_no_function_is_over_60_lines() -> None:
    long = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno is not None and node.end_lineno - first + 1 > 60:
                    long.append(f"{_name(path)}:{node.lineno} {node.name} ({node.end_lineno - first + 1} lines)")
    assert long == [], "functions over 60 lines (STYLE.md): " + "; ".join(long)


# What asks which backend runs: the DeepSpeed JSON used as a flag, Accelerate's DeepSpeed wrapper or FSDP2 flag, the
# resolved backend's name compared, a `deepspeed: bool` parameter.
_BACKEND_QUESTION = re.compile(r"\bds is (not )?None|deepspeed_engine_wrapped|is_fsdp2|DistributedType\."
                               r"|resolved\.backend\s*[=!]=|backend\s*[=!]=\s*\"(deepspeed|fsdp|ddp)\"|deepspeed: bool")


def test_only_the_backends_ask_which_backend_runs() -> None:
    asked = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        if "backends" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _BACKEND_QUESTION.search(line.split("#")[0]):
                asked.append(f"{_name(path)}:{number}: {line.strip()}")
    assert asked == [], "asked outside train/backends/: " + "; ".join(asked)


def test_the_backend_question_pattern_matches_what_it_names() -> None:
    for line in ("if ds is not None:", "x = accelerator.deepspeed_engine_wrapped.engine", 'if backend != "fsdp":',
                 "if cfg.resolved.backend == 'x'", "def f(deepspeed: bool) -> None:", "accelerator.is_fsdp2"):
        assert _BACKEND_QUESTION.search(line), line
    assert not _BACKEND_QUESTION.search("backend = backends.of(cfg, ds)")


def test_no_module_uses_another_modules_private_names() -> None:
    """`from ds_trainer.x import _y` or `x._y` on a ds_trainer module imported as `x` (a library's private name,
    DeepSpeed's internals that a workaround needs, is the workaround's own business and says why)."""
    used = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        ours: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ds_trainer"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        used.append(f"{_name(path)}:{node.lineno} imports {node.module}.{alias.name}")
                    ours.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                ours.update(a.asname or a.name for a in node.names if a.name.startswith("ds_trainer"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                used.append(f"{_name(path)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert used == [], "private names used across modules: " + "; ".join(used)


def _page_paths(page: str) -> set[str]:
    """The modules the page's tree names, at their paths (`ds_trainer/train/state/ema.py`): a folder's line (`x/`)
    opens it at its indentation (two spaces a level), a line of modules names them in the open folders; the
    descriptions' continuation lines (indented 24 or more) name none."""
    block = "conf/" + page.split("```\nconf/", 1)[1].split("```", 1)[0]
    folders: dict[int, str] = {}
    found = set()
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= 24:
            continue
        level = indent // 2
        for token in line.split():
            if token.endswith("/"):
                folders = {k: v for k, v in folders.items() if k < level} | {level: token[:-1]}
                break
            if not token.endswith(".py"):
                break
            found.add("/".join([*(folders[i] for i in range(level)), token]))
    return found


def test_the_architecture_page_names_every_module_at_its_path() -> None:
    named = _page_paths((ROOT / "docs" / "architecture.md").read_text())
    modules = {str(p.relative_to(ROOT)) for p in MODULES}
    missing = sorted(m for m in modules if m not in named and not m.endswith("/__init__.py"))
    invented = sorted(n for n in named if n.startswith("ds_trainer/") and n not in modules)
    assert missing == [], "docs/architecture.md does not name at its path: " + ", ".join(missing)
    assert invented == [], "docs/architecture.md names modules that are not there: " + ", ".join(invented)


def test_the_page_s_tree_is_read_by_path() -> None:
    """A module named in the wrong folder is not at its path: the reading can fail."""
    tree = "```\nconf/\nds_trainer/\n  a.py\n  sub/\n    b.py c.py\n  d.py\n```"
    assert _page_paths(tree) == {"ds_trainer/a.py", "ds_trainer/sub/b.py", "ds_trainer/sub/c.py", "ds_trainer/d.py"}

def _family_names_asked(tree: ast.AST, names: set[str], tables: bool = True) -> list[tuple[int, str]]:
    """Where a family's name is compared (`family == "flux"`, `in ("sd3", "flux")`) or keys a table
    (`{"flux": ...}`; with `tables`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found += [(node.lineno, sub.value) for sub in ast.walk(side)
                          if isinstance(sub, ast.Constant) and sub.value in names]
        elif isinstance(node, ast.Dict) and tables:
            found += [(node.lineno, k.value) for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
    return found


def test_only_the_families_and_their_specs_name_a_family() -> None:
    """Outside train/families/ and config/families/ (the registry), nothing compares a family's name or keys a
    table by it: the code asks the family's spec (config/families/) or its implementation."""
    from ds_trainer.config import families

    names = set(families.NAMES)
    asked = []
    for path in MODULES:
        if {"families"} & set(path.relative_to(PACKAGE).parts[:-1]):
            continue
        asked += [f"{_name(path)}:{line} {name!r}" for line, name in _family_names_asked(ast.parse(path.read_text()),
                                                                                        names)]
    assert asked == [], "a family named outside its folder and the registry: " + "; ".join(asked)


def test_the_family_name_walk_finds_a_comparison_and_a_table() -> None:
    tree = ast.parse('if cfg.model.family.value in ("sd3", "flux"):\n    x = {"qwen_image": 1}\ny = f == "sdxl"\n'
                     'z = "flux_tiny"\n')
    assert sorted(name for _, name in _family_names_asked(tree, {"sdxl", "sd3", "flux", "qwen_image"})) == \
        ["flux", "qwen_image", "sd3", "sdxl"]


def test_no_code_compares_a_format_name() -> None:
    """The formats a run writes are records (config/formats.py) with writers (tables keyed by the format, the
    writers' registries): nothing tests `fmt != "kohya"` (a format added later would make each such test write the
    others too)."""
    from ds_trainer.config import formats

    names = {*formats.LORA, *formats.MODEL}
    asked = [f"{_name(path)}:{line} {name!r}" for path in MODULES
             for line, name in _family_names_asked(ast.parse(path.read_text()), names, tables=False)]
    assert asked == [], "a format name compared: " + "; ".join(asked)


# A parameter's layout as DeepSpeed and FSDP2 keep it: their attributes, accessors and DTensor's own names.
_LAYOUT_ATTRIBUTES = {"ds_id", "ds_tensor", "ds_shape", "ds_numel", "ds_status", "_hp_mapping", "to_local",
                      "full_tensor", "device_mesh", "placements"}
_LAYOUT_NAMES = {"DTensor", "GatheredParameters", "distribute_tensor", "safe_get_full_fp32_param",
                 "safe_set_full_fp32_param", "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
                 "safe_get_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_fp32_param"}
_BACKEND_MODULES = {"deepspeed", "fsdp", "ddp", "nvme_swap"}
# The GPU check's probes import nothing of ds_trainer (they measure torch and the libraries themselves, on a machine
# whose ds_trainer may not install): the FSDP2 probe reads a DTensor's placement itself.
_LAYOUT_STILL_ASKED = {"gpucheck/probes.py"}


def _layout_asked(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _LAYOUT_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in _LAYOUT_ATTRIBUTES:
            found.append((node.lineno, repr(node.value)))  # hasattr(p, "ds_id")
        elif isinstance(node, ast.Name) and node.id in _LAYOUT_NAMES:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names}
            if node.module == "ds_trainer.train.backends" and names & _BACKEND_MODULES:
                found.append((node.lineno, f"imports backends.{sorted(names & _BACKEND_MODULES)[0]}"))
            elif (node.module or "").removeprefix("ds_trainer.train.backends.") in _BACKEND_MODULES:
                found.append((node.lineno, f"imports {node.module}"))
            found += [(node.lineno, n) for n in sorted(names & _LAYOUT_NAMES)]
    return found


def test_only_the_backends_ask_how_a_parameter_is_laid_out() -> None:
    """Outside train/backends/ nothing names DeepSpeed's or FSDP2's parameter attributes or accessors, nor imports
    a backend's own module: the parts ask their backend's layout object (train/backends/params.py, `run.params`),
    read by AST."""
    asked = []
    for path in MODULES:
        name = _name(path)
        if path.relative_to(PACKAGE).parts[:2] == ("train", "backends") or name in _LAYOUT_STILL_ASKED:
            continue
        asked += [f"{name}:{line} {what}" for line, what in _layout_asked(ast.parse(path.read_text()))]
    assert asked == [], "a parameter's layout asked outside train/backends/: " + "; ".join(asked)


def test_the_layout_walk_finds_what_it_names() -> None:
    tree = ast.parse('if hasattr(p, "ds_id"):\n    x = p.ds_tensor\nfrom torch.distributed.tensor import DTensor\n'
                     "from ds_trainer.train.backends import deepspeed, inner\ny = shard.to_local()\n")
    assert sorted(what for _, what in _layout_asked(tree)) == sorted(
        ["'ds_id'", "ds_tensor", "DTensor", "imports backends.deepspeed", "to_local"])


def _loose_conditionals(tree: ast.AST) -> int:
    """Conditional expressions that hold another or span several lines (STYLE.md: one decision per line)."""
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.IfExp) and (
        node.end_lineno != node.lineno or any(isinstance(s, ast.IfExp) for s in ast.walk(node) if s is not node)))


def test_no_module_gains_a_nested_or_multi_line_conditional_expression() -> None:
    """A ratchet: each module has at most the nested or multi-line conditional expressions it had when the rule came
    (tests/data/loose_conditionals.json; a new module none), and the file is lowered as they are rewritten as `if`
    statements or calls, so the figure only falls."""
    import json

    allowed: dict[str, int] = json.loads((ROOT / "tests" / "data" / "loose_conditionals.json").read_text())
    now = {_name(p): n for p in MODULES if (n := _loose_conditionals(ast.parse(p.read_text())))}
    grown = [f"{m}: {n} (at most {allowed.get(m, 0)})" for m, n in sorted(now.items()) if n > allowed.get(m, 0)]
    fallen = [f"{m}: {now.get(m, 0)}" for m, n in sorted(allowed.items()) if now.get(m, 0) < n]
    assert grown == [], "nested or multi-line conditional expressions added: " + "; ".join(grown)
    assert fallen == [], "fewer now, lower tests/data/loose_conditionals.json to: " + "; ".join(fallen)


def test_the_loose_conditional_count_finds_both_kinds() -> None:
    tree = ast.parse("a = 1 if x else 2\nb = 1 if x else 2 if y else 3\nc = (1 if x\n     else 2)\n")
    assert _loose_conditionals(tree) == 2


def test_no_module_gains_a_line_over_100_characters() -> None:
    """A ratchet toward 100 columns (ruff holds 120 for the code written before): a new module has no line over 100
    characters, an older one at most those it had (tests/data/long_lines.json, lowered as they are rewrapped)."""
    import json

    allowed: dict[str, int] = json.loads((ROOT / "tests" / "data" / "long_lines.json").read_text())
    now = {_name(p): n for p in MODULES if (n := sum(len(line) > 100 for line in p.read_text().splitlines()))}
    grown = [f"{m}: {n} (at most {allowed.get(m, 0)})" for m, n in sorted(now.items()) if n > allowed.get(m, 0)]
    fallen = [f"{m}: {now.get(m, 0)}" for m, n in sorted(allowed.items()) if now.get(m, 0) < n]
    assert grown == [], "lines over 100 characters added: " + "; ".join(grown)
    assert fallen == [], "fewer now, lower tests/data/long_lines.json to: " + "; ".join(fallen)
