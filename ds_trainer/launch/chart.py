"""The report's and the tuner's charts, readable at any cell count.

Every cell gets a bar in each of the per-cell panels: horizontal bars, one row per cell, so the
figure grows in height with the cells and a name is never drawn over another. The scatter panels
(memory against images/s, validation loss against s/it and against memory) draw every cell but name
only the cells on the Pareto front (none better on both axes) and the winner; a name that would
cover another is left off, and the panel says how many were. Names are placed by measuring the drawn
text, so "no overlap" is what the renderer drew.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROW_IN = 0.24  # inches per cell in the bar panels: 8-point names one above the other
SCATTER_IN = 5.5
# Where a name is tried around its point (offset points), in order.
OFFSETS = ((5, 5), (5, -11), (-5, 5), (-5, -11), (5, 14), (5, -20))


def pareto(points: Sequence[tuple[float, float]], x_low: bool = True,
           y_low: bool = True) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x when `x_low`, else higher; y
    alike)."""
    def better(a: tuple[float, float], b: tuple[float, float]) -> bool:  # a dominates b
        ax, ay = (a[0] if x_low else -a[0]), (a[1] if y_low else -a[1])
        bx, by = (b[0] if x_low else -b[0]), (b[1] if y_low else -b[1])
        return ax <= bx and ay <= by and (ax, ay) != (bx, by)

    return [i for i, p in enumerate(points) if not any(better(q, p) for q in points)]


def place_labels(ax: Any, names: Sequence[tuple[str, float, float, str]]) -> int:
    """Write each (name, x, y, colour) beside its point, in order, at the first offset where it
    covers no name already written and stays inside the panel; returns how many found no such place.
    """
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    taken: list[Any] = []
    left_out = 0
    for name, x, y, colour in names:
        for dx, dy in OFFSETS:
            text = ax.annotate(name, (x, y), fontsize=7, xytext=(dx, dy),
                               textcoords="offset points", ha="left" if dx > 0 else "right",
                               color=colour)
            box = text.get_window_extent(renderer)
            inside = (frame.x0 <= box.x0 and box.x1 <= frame.x1
                      and frame.y0 <= box.y0 and box.y1 <= frame.y1)
            if inside and not any(box.overlaps(t) for t in taken):
                taken.append(box)
                break
            text.remove()
        else:
            left_out += 1
    return left_out


def scatter(ax: Any, points: Sequence[dict[str, Any]], xlabel: str, ylabel: str, title: str,
            x_low: bool, y_low: bool) -> dict[str, Any]:
    """One point per dict (x, y, label, failed, winner); the Pareto front of the points that did not
    fail joined by a line, the winner as a star. Returns what `name_points` writes once the layout
    is final: the names of the front and the winner, and the title's count of the cells left
    unnamed."""
    good = [p for p in points if not p.get("failed")]
    front = [good[i] for i in pareto([(p["x"], p["y"]) for p in good], x_low, y_low)]
    for p in points:
        on_front = any(p is q for q in front)
        if p.get("winner"):
            ax.scatter([p["x"]], [p["y"]], marker="*", s=300, color="tab:red", zorder=4,
                       label="winner")
        elif p.get("failed"):
            ax.scatter([p["x"]], [p["y"]], marker="x", color="tab:gray", zorder=2)
        else:
            ax.scatter([p["x"]], [p["y"]], color="tab:orange" if on_front else "tab:blue",
                       zorder=3 if on_front else 2, s=30 if on_front else 16)
    if len(front) > 1:
        line = sorted(front, key=lambda p: p["x"])
        ax.plot([p["x"] for p in line], [p["y"] for p in line], color="tab:orange", linewidth=1,
                zorder=1, label="Pareto front")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(0.15)
    # Two lines from the start: the layout, made before the names go in, keeps room for a count.
    ax.set_title(f"{title}\n ", fontsize=10)
    if any(p.get("winner") for p in points) or len(front) > 1:
        ax.legend(loc="best", fontsize=8)
    named = [p for p in points if p.get("winner")] + [p for p in front if not p.get("winner")]
    return {"ax": ax, "title": title, "named": named, "total": len(points)}


def name_points(fig: Any, panels: Sequence[dict[str, Any]]) -> None:
    """Draw the figure once, fix its layout, then name each scatter panel's points (`scatter`'s
    records) where they cover nothing, and say in each title how many cells it left unnamed."""
    fig.canvas.draw()
    fig.set_layout_engine("none")  # a later layout would move the panels under the measured names
    for panel in panels:
        named = panel["named"]
        left_out = place_labels(panel["ax"], [(p["label"], p["x"], p["y"], "black") for p in named])
        unnamed = panel["total"] - len(named) + left_out
        note = f"({unnamed} of {panel['total']} cells not named here: see the table)"
        note = note if unnamed else " "
        panel["ax"].set_title(f"{panel['title']}\n{note}", fontsize=10)


def bars(ax: Any, names: Sequence[str], values: Sequence[float], failed: Sequence[str | None],
         title: str, show_names: bool) -> None:
    """One horizontal bar per cell, top to bottom in the table's order; a failed cell shows its
    status."""
    rows = range(len(names))
    ax.barh(rows, values, color=["tab:gray" if f else "tab:blue" for f in failed])
    for row, status in zip(rows, failed, strict=True):
        if status:
            ax.text(0, row, f" {status}", va="center", ha="left", fontsize=7, color="tab:red")
    ax.set_yticks(list(rows), list(names) if show_names else [], fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def figure(columns: int, bar_rows: int | None, scatter_rows: int) -> tuple[Any, list[list[Any]]]:
    """A figure with a row of bar panels `bar_rows` cells high (None: no bars) above `scatter_rows`
    rows of square-ish scatter panels, `columns` panels a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [SCATTER_IN] * scatter_rows
    if bar_rows is not None:
        heights.insert(0, max(SCATTER_IN, ROW_IN * bar_rows + 1.2))
    fig, grid = plt.subplots(len(heights), columns, figsize=(6 * columns, sum(heights)),
                             squeeze=False, gridspec_kw={"height_ratios": heights},
                             layout="constrained")
    return fig, [list(row) for row in grid]


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
