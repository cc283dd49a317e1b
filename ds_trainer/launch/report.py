"""Sweep report: one row per cell, as markdown, CSV and a PNG chart (and a W&B table when W&B is on).

    python -m ds_trainer.report outputs/sweeps/<date>/<time>-<id>

Works on a sweep that is still running or partly failed: a cell without `summary.json` is `running`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from ds_trainer.config import families, schema
from ds_trainer.config.ds_config import option_name
from ds_trainer.launch.chart import bars, name_points, save, scatter
from ds_trainer.launch.chart import figure as chart_figure

COLUMNS = ("cell", "zero", "offload", "resolution", "micro_batch_size", "world_size", "precision", "optimizer",
           "status", "gpu_mem_peak_allocated_mib", "gpu_mem_peak_reserved_mib", "host_rss_peak_mib", "median_s_per_it",
           "images_per_s", "compile", "compile_s", "val_loss", "val_loss_ema", "gradient_accumulation_steps",
           "gradient_checkpointing", "model", "trained", "trained_params", "sources", "message")
HEADERS = {"micro_batch_size": "micro batch", "gradient_accumulation_steps": "accum", "gradient_checkpointing": "ckpt",
           "world_size": "world", "gpu_mem_peak_allocated_mib": "peak VRAM MiB",
           "gpu_mem_peak_reserved_mib": "reserved MiB", "host_rss_peak_mib": "host RSS MiB",
           "median_s_per_it": "median s/it", "images_per_s": "images/s", "val_loss": "val loss",
           "val_loss_ema": "val loss EMA", "trained_params": "trained parameters", "compile_s": "compile s",
           "sources": "samples per source (captions dropped, files skipped)"}
# Quality is compared between cells that finished: a cell that failed or is still running shows no value (its last
# validation scored weights that did not train to the end), never a zero.
QUALITY = ("val_loss", "val_loss_ema")


def _cell_config(cell: Path) -> dict[str, Any]:
    for path in (cell / "config.yaml", cell / ".hydra" / "config.yaml"):
        if path.exists():
            return yaml.safe_load(path.read_text()) or {}
    return {}


def _row(cell: Path, root: Path) -> dict[str, Any]:
    summary_path = cell / "summary.json"
    cfg = _cell_config(cell)
    # No summary yet: still running, or a dry run's cell (its run files written, nothing to train).
    pending = {"status": "composed" if cfg.get("dry_run") else "running"}
    row: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else pending
    if cfg and "zero" not in row:
        zero = cfg.get("zero", {})
        row["zero"] = option_name(str(zero.get("backend")), zero.get("stage"))
        row["offload"] = cfg.get("offload", {}).get("device")
        res = cfg.get("resolution", {})
        row["resolution"] = f"{res.get('width')}x{res.get('height')}"
        row["micro_batch_size"] = cfg.get("train", {}).get("micro_batch_size")
        row["gradient_accumulation_steps"] = cfg.get("train", {}).get("gradient_accumulation_steps")
        row["gradient_checkpointing"] = cfg.get("train", {}).get("gradient_checkpointing")
        row["precision"] = cfg.get("precision", {}).get("name")
        row["optimizer"] = (cfg.get("resolved") or {}).get("optimizer") or cfg.get("optimizer", {}).get("name")
        row["world_size"] = (cfg.get("resolved") or {}).get("world_size") or cfg.get("world_size")
    if cfg:
        row["model"] = (cfg.get("model") or {}).get("name")
        row["trained"] = trained(cfg)
        compiled = (cfg.get("train") or {}).get("compile", "none")
        row["compile"] = None if compiled == "none" else compiled  # train.compile (its seconds: compile_s)
    counts = row.get("trained_parameters")
    if isinstance(counts, dict):
        row["trained_params"] = " + ".join(f"{name} {_count(n)}" for name, n in counts.items())
    found = row.pop("sources", None)
    if isinstance(found, list) and [s.get("kind") for s in found] != ["synthetic"]:  # images the user keeps
        row["sources"] = "; ".join(_source(s) for s in found)
    row["cell"] = str(cell.relative_to(root))
    if row.get("status") != "ok":
        for key in QUALITY:
            row.pop(key, None)
    return row


def _source(entry: dict[str, Any]) -> str:
    """One source of a cell: its samples seen, captions dropped and files skipped (summary.json's `sources`)."""
    extra = [f"{entry['captions_dropped']} dropped"] if entry.get("captions_dropped") else []
    skipped = sum((entry.get("skipped") or {}).values())
    extra += [f"{skipped} skipped"] if skipped else []
    reg = " (regularisation)" if entry.get("regularization") else ""
    return f"{entry.get('name')}{reg} {entry.get('samples_seen', 0)}" + (f" ({', '.join(extra)})" if extra else "")


def trained(cfg: dict[str, Any]) -> str:
    """What a cell trained, from its config.yaml: `unet` or `transformer` (SD3's, Flux's) whole or as `... lora` (or
    `dora`, `lokr`, `loha`; `on an nf4 base` with `quantize=`), and the text encoders that trained with it
    (`+ text encoders lora (both)`)."""
    adapter = (cfg.get("adapter") or {}).get("method", "none")
    quantized = (cfg.get("quantize") or {}).get("kind", "none")
    module = families.of(cfg).component
    out = module if adapter == "none" else f"{module} {adapter}"
    if adapter != "none" and quantized != "none":
        out += f" on an {quantized} base"
    if schema.trains_text_encoders(cfg):
        te = cfg["text_encoders"]
        out += f" + text encoders {te['mode']} ({te.get('which', 'both')})"
    return out


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def cells(sweep_dir: Path) -> list[Path]:
    """Cell folders of a sweep: those Hydra made (`.hydra/`) or that hold a run's files; not the
    phases of a run in phases (config/phases.py: runs of their own inside the cell's folder)."""
    found = {p.parent for p in sweep_dir.rglob(".hydra")} | {p.parent for p in sweep_dir.rglob("summary.json")}
    found = {c for c in found if ".submitit" not in c.parts}
    found = {c for c in found if not any(parent in found for parent in c.parents)}
    return sorted(found, key=lambda c: [int(p) if p.isdigit() else p for p in c.relative_to(sweep_dir).parts])


def rows(sweep_dir: Path) -> list[dict[str, Any]]:
    return [_row(c, sweep_dir) for c in cells(sweep_dir)]


def fmt(value: Any) -> str:
    """A report cell: empty for None, floats to their shown digits, the rest as text."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")


# Columns shown only when some cell has a value: the quality ones when a cell was validated (`validation=on`), what
# trained (and the model) when the cells' folders say (runs before it was recorded, or summaries alone, do not),
# train.compile and its seconds when a cell compiled.
OPTIONAL = (*QUALITY, "model", "trained", "trained_params", "sources", "compile", "compile_s")


def columns(table: list[dict[str, Any]]) -> tuple[str, ...]:
    """The table's columns (OPTIONAL ones only where some cell has a value)."""
    return tuple(c for c in COLUMNS if c not in OPTIONAL or any(r.get(c) is not None for r in table))


def _fmt_cell(column: str, value: Any) -> str:
    if column in QUALITY and isinstance(value, float):
        return f"{value:.5f}"  # the differences between cells are in the third and fourth decimals
    return fmt(value)


def markdown(table: list[dict[str, Any]]) -> str:
    shown = columns(table)
    head = [HEADERS.get(c, c) for c in shown]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_fmt_cell(c, r.get(c)) for c in shown) + " |" for r in table]
    count = Counter(str(r.get("status")) for r in table)
    failed = sum(n for status, n in count.items() if status not in ("ok", "running", "composed"))
    said = f"{count['ok']} ok, {failed} failed, {count['running']} running"
    if count["composed"]:
        said += f", {count['composed']} composed (a dry run: nothing trained)"
    lines.append(f"\n{len(table)} cells: {said}")
    return "\n".join(lines) + "\n"


def csv_text(table: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns(table), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(table)
    return out.getvalue()


AXES = ("model", "zero", "offload", "resolution", "micro_batch_size", "gradient_accumulation_steps",
        "gradient_checkpointing", "precision", "optimizer", "trained", "compile", "world_size")
_SHORT = {"micro_batch_size": "b", "gradient_accumulation_steps": "accum ", "world_size": "ranks ",
          "gradient_checkpointing": "ckpt "}


def labels(table: list[dict[str, Any]]) -> list[str]:
    """Each cell named by every axis that varies in this sweep (all of zero/offload when nothing varies)."""
    varying = [a for a in AXES if len({str(r.get(a)) for r in table}) > 1] or ["zero", "offload"]
    def name(r: dict[str, Any]) -> str:
        parts = []
        for axis in varying:
            value = r.get(axis)
            if axis == "gradient_checkpointing":
                parts.append("ckpt" if value else "no ckpt")
            elif axis == "compile":
                parts.append(f"compile={value}" if value else "eager")
            else:
                parts.append(f"{_SHORT.get(axis, '')}{value}")
        return " ".join(parts)
    return [name(r) for r in table]


def _speed_points(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Memory (x) against images/s (y); a failed cell at 0 with its status in its name."""
    out = []
    for p in points:
        if p.get("memory") is None:
            continue
        ok = p.get("status") == "ok"
        out.append({"x": float(p["memory"]), "y": float(p.get("images_per_s") or 0) if ok else 0.0,
                    "label": p["label"] if ok else f"{p['label']} ({p.get('status')})", "failed": not ok,
                    "winner": bool(p.get("winner"))})
    return out


def memory_speed(points: list[dict[str, Any]], path: Path, xlabel: str, budget: float | None = None,
                 title: str = "memory against speed") -> None:
    """Memory (x) against images/s (y), one point per cell; failed cells drawn at 0 with their status,
    the winner (`winner: True`) as a star, the Pareto front named. Points: label, status, memory,
    images_per_s, winner."""
    fig, grid = chart_figure(1, None, 1)
    ax = grid[0][0]
    fig.set_size_inches(9, 6)
    if budget is not None:
        ax.axvline(budget, color="tab:red", linestyle="--", linewidth=1, label="budget")
    panel = scatter(ax, _speed_points(points), xlabel, "images/s (failed cells at 0)", title,
                    x_low=True, y_low=False)
    name_points(fig, [panel])
    save(fig, path)


def _quality_points(table: list[dict[str, Any]], names: list[str], x_key: str) -> list[dict[str, Any]]:
    """Validation loss (y) against a cost (x), one point per finished cell with both."""
    return [{"x": float(r[x_key]), "y": float(r["val_loss"]), "label": name}
            for name, r in zip(names, table, strict=True)
            if r.get("val_loss") is not None and r.get(x_key) is not None]


def sweep_figure(table: list[dict[str, Any]]) -> Any:
    """Peak memory, s/it and images/s per cell (a bar each; failed cells show their status), then memory
    against images/s and, when the cells were validated, the validation loss against s/it and against memory
    (lower left is better), each with its Pareto front named."""
    gpu = any(r.get("gpu_mem_peak_allocated_mib") for r in table)
    mem_key, mem_label = (("gpu_mem_peak_allocated_mib", "peak VRAM allocated (MiB)") if gpu
                          else ("host_rss_peak_mib", "peak host RSS (MiB), no GPU"))
    names = labels(table)
    fig, (top, bottom) = chart_figure(3, len(table), 1)
    failed = [None if r.get("status") == "ok" else str(r.get("status", "?")) for r in table]
    panels = ((mem_key, mem_label), ("median_s_per_it", "median s/it"), ("images_per_s", "images/s"))
    for n, (ax, (key, title)) in enumerate(zip(top, panels, strict=True)):
        bars(ax, names, [float(r.get(key) or 0) for r in table], failed, title, show_names=n == 0)
    speed = [{"label": n, "status": r.get("status"), "memory": r.get(mem_key), "images_per_s": r.get("images_per_s")}
             for n, r in zip(names, table, strict=True)]
    scatters = [scatter(bottom[0], _speed_points(speed), mem_label, "images/s (failed cells at 0)",
                        "memory against images/s", x_low=True, y_low=False)]
    scatters[0]["total"] = len(table)  # a failed cell without a memory figure is not drawn: unnamed too
    if "val_loss" in columns(table):
        for ax, (key, label) in zip(bottom[1:], ((("median_s_per_it", "median s/it")), (mem_key, mem_label)),
                                    strict=True):
            points = _quality_points(table, names, key)
            scatters.append(scatter(ax, points, label, "validation loss (lower is better)",
                                    f"quality against {label.split(' (')[0]}", x_low=True, y_low=True))
            scatters[-1]["total"] = len(table)  # the cells without a value count as unnamed too
    else:
        for ax in bottom[1:]:
            ax.axis("off")
    name_points(fig, scatters)
    return fig


def chart(table: list[dict[str, Any]], path: Path) -> None:
    """The sweep's chart (`sweep_figure`) as a PNG."""
    save(sweep_figure(table), path)


def to_wandb(sweep_dir: Path, table: list[dict[str, Any]]) -> bool:
    """Log the table to W&B when the sweep's cells used W&B (same project and mode, the sweep as group)."""
    configs = [_cell_config(c) for c in cells(sweep_dir)]
    logger = next((c.get("logger") for c in configs if c.get("logger")), None)
    if not logger or logger.get("name") != "wandb" or logger.get("mode") == "disabled":
        return False
    import wandb

    run = wandb.init(project=logger.get("project"), entity=logger.get("entity"), mode=logger.get("mode"),
                     group=logger.get("group") or sweep_dir.name, name=f"report {sweep_dir.name}",
                     job_type="sweep_report", dir=str(sweep_dir))
    shown = columns(table)
    run.log({"sweep_report": wandb.Table(columns=list(shown), data=[[r.get(c) for c in shown] for r in table])})
    run.finish()
    return True


def write(sweep_dir: Path, use_wandb: bool = True) -> dict[str, Path]:
    """Write report.md, report.csv and report.png into the sweep folder."""
    table = rows(sweep_dir)
    out = {"md": sweep_dir / "report.md", "csv": sweep_dir / "report.csv", "png": sweep_dir / "report.png"}
    out["md"].write_text(f"# Sweep {sweep_dir}\n\n" + markdown(table)
                         + "\n![peak memory, s/it and quality](report.png)\n")
    out["csv"].write_text(csv_text(table))
    if table:
        chart(table, out["png"])
    if use_wandb:
        to_wandb(sweep_dir, table)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--no-wandb", action="store_true", help="do not log the table to W&B")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"report: {args.sweep_dir} is not a folder", file=sys.stderr)
        return 2
    out = write(args.sweep_dir, use_wandb=not args.no_wandb)
    print(markdown(rows(args.sweep_dir)))
    print(f"written: {out['md']}, {out['csv']}" + (f", {out['png']}" if out["png"].exists() else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
