"""What a quality tune leaves in its folder: quality.md, quality.csv, quality.png, winner.txt, the
experiment preset, and the study as a W&B table.

quality.md names the chosen trial (the lowest validation loss of those that ran to their end) with
its overrides and its loss beside the same training run again from scratch, the importance of each
axis (Optuna's PED-ANOVA over the losses every trial reached at the first rung: the same images
seen), the best loss reached against the device-hours spent, and every trial: its parameters, its
loss at each rung, what ended it, its seeds. quality.png draws each trial's validation loss against
the study's wall-clock (pruned ones dashed, to the rung that stopped them) and the best loss against
device-hours.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Any

from ds_trainer.launch.report import fmt
from ds_trainer.tools.tune import outputs

STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running",
          "WAITING": "waiting"}


def state(trial: Any) -> str:
    """complete, pruned, failed, refused (never run), repeat (another trial's result), ..."""
    if "refused" in trial.user_attrs:
        return "refused"
    if "repeat_of" in trial.user_attrs:
        return "repeat"
    return STATES.get(trial.state.name, trial.state.name.lower())


def rungs(setup: Any) -> list[int]:
    """The images seen at each rung: the first, then x tune.reduction up to a trial's end."""
    out, images = [], setup.rung
    while images < setup.last:
        out.append(images)
        images *= int(setup.cfg.tune.reduction)
    return [*out, setup.last]


def _start(trials: list[Any]) -> float:
    starts = [t.datetime_start.timestamp() for t in trials if t.datetime_start is not None]
    return min(starts) if starts else 0.0


def row(trial: Any, setup: Any, start: float, lost: str | None = None) -> dict[str, Any]:
    """A trial's row of quality.csv and quality.md."""
    attrs = trial.user_attrs
    values = trial.intermediate_values
    began = trial.datetime_start.timestamp() - start if trial.datetime_start else None
    r: dict[str, Any] = {"trial": trial.number, "state": state(trial)}
    r.update({a.key: trial.params.get(a.key) for a in setup.axes})
    r.update({f"loss@{n}": values.get(n) for n in rungs(setup)})
    r.update({"val_loss": trial.value if trial.state.name == "COMPLETE" else None,
              "steps": attrs.get("steps"), "device_h": _hours(attrs.get("device_s")),
              "started_s": None if began is None else round(began, 1),
              "seeds": _seeds(attrs.get("seeds")), "worker": _worker(attrs.get("worker")),
              "message": _message(attrs, lost)})
    return r


def _hours(seconds: Any) -> float | None:
    return None if seconds is None else float(seconds) / 3600


def _seeds(seeds: dict[str, int] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (seeds or {}).items())


def _worker(worker: dict[str, Any] | None) -> str:
    return f"{worker['host']}:{worker['pid']}" if worker else ""


def _message(attrs: dict[str, Any], lost: str | None) -> str:
    parts = [str(attrs[k]) for k in ("refused", "message") if k in attrs]
    if "repeat_of" in attrs:
        parts.append(f"the parameters of trial {attrs['repeat_of']}: its result, not run again")
    if "retry_of" in attrs:
        parts.append(f"trial {attrs['retry_of']} again (its worker was lost)")
    return "; ".join([*parts, *([lost] if lost else [])])


def importance(study: Any, setup: Any) -> tuple[dict[str, float], int]:
    """Each axis's importance (PED-ANOVA) over the trials' losses at the first rung, and how
    many trials it rests on ({} with too few)."""
    import optuna

    dists = setup.distributions
    at_rung = [t for t in study.get_trials(deepcopy=False) if setup.rung in t.intermediate_values
               and "repeat_of" not in t.user_attrs and set(t.params) == set(dists)]
    if len(at_rung) < 3 or len({t.intermediate_values[setup.rung] for t in at_rung}) < 2:
        return {}, len(at_rung)
    scored = optuna.create_study(direction="minimize")
    scored.add_trials([optuna.trial.create_trial(params=t.params, distributions=dists,
                                                 value=t.intermediate_values[setup.rung])
                       for t in at_rung])
    try:
        return dict(optuna.importance.get_param_importances(scored)), len(at_rung)
    except (RuntimeError, ValueError):  # a space PED-ANOVA cannot split (too few distinct values)
        return {}, len(at_rung)


def anytime(trials: list[Any]) -> list[tuple[float, float, int]]:
    """(device-hours spent, best loss so far, its trial) as trials ended, in the order they did."""
    out: list[tuple[float, float, int]] = []
    ended = sorted((t for t in trials if t.datetime_complete is not None),
                   key=lambda t: t.datetime_complete)
    spent, best = 0.0, None
    for t in ended:
        spent += float(t.user_attrs.get("device_s", 0.0))
        if t.state.name == "COMPLETE" and "repeat_of" not in t.user_attrs and (
                best is None or t.value < best[0]):
            best = (t.value, t.number)
        if best is not None and (not out or out[-1][1:] != best):
            out.append((spent / 3600, best[0], best[1]))
    return out


def line(setup: Any, params: dict[str, Any]) -> list[str]:
    """The training line of a trial's parameters, as the user runs it."""
    cfg = setup.cfg
    own = [f"train.max_steps={cfg.train.max_steps}", f"validation.every={cfg.validation.every}"]
    return [*setup.base, *own, *(a.override(params[a.key]) for a in setup.axes)]


def chart(study: Any, best: Any, path: Path) -> None:
    """quality.png: each trial's loss against the study's wall-clock, the best against
    device-hours."""
    from ds_trainer.launch.chart import figure, save

    trials = study.get_trials(deepcopy=False)
    start = _start(trials)
    fig, grid = figure(2, None, 1)
    ax, right = grid[0]
    styles = {"complete": ("-", 1.2), "pruned": ("--", 0.8), "failed": (":", 0.8),
              "running": ("-", 0.8)}
    for t in trials:
        curve, kind = t.user_attrs.get("curve") or [], state(t)
        if not curve or kind not in styles or t.datetime_start is None:
            continue
        x = [(t.datetime_start.timestamp() - start + s) / 60 for _, s, _ in curve]
        y = [v for _, _, v in curve]
        style, width = styles[kind]
        chosen = best is not None and t.number == best.number
        drawn = ax.plot(x, y, style, lw=3 if chosen else width, marker="." if len(x) < 2 else None)
        end = {"pruned": "x"}.get(kind, "o")
        if chosen:
            end = "*"
        ax.plot(x[-1:], y[-1:], end, color=drawn[0].get_color(), ms=12 if chosen else 6)
        ax.annotate(str(t.number), (x[-1], y[-1]), fontsize=7, xytext=(3, 0),
                    textcoords="offset points")
    ax.set(xlabel="study wall-clock (min)", ylabel="validation loss",
           title="each trial (dashed, x: pruned at a rung; *: chosen)")
    steps = anytime(trials)
    if steps:  # to the device-hours spent in all: the best held from its trial on
        total = sum(float(t.user_attrs.get("device_s", 0.0)) for t in trials) / 3600
        x, y = [h for h, _, _ in steps] + [total], [v for _, v, _ in steps] + [steps[-1][1]]
        right.step(x, y, where="post")
        right.plot(x[:-1], y[:-1], "o")
    right.set(xlabel="device-hours spent (trials x ranks)", ylabel="best validation loss so far",
              title="the best loss reached against device-hours")
    for panel in (ax, right):
        panel.grid(alpha=0.3)
    save(fig, path)


def markdown(study: Any, setup: Any, best: Any, again: dict[str, Any] | None) -> str:
    """quality.md: the chosen trial and its line, the rerun, importance, the anytime curve, every
    trial."""
    trials = study.get_trials(deepcopy=False)
    t = setup.cfg.tune
    seconds, steps = _spent(trials)
    counts = {k: sum(state(x) == k for x in trials) for k in
              ("complete", "pruned", "failed", "refused", "repeat")}
    lines = [f"# Quality tune {t.name}", "",
             f"Training overrides: `{' '.join(setup.base)}`; axes: "
             + ", ".join(f"`{a.key}={a.given}`" for a in setup.axes) + ".",
             f"Each trial {setup.last} images ({setup.cfg.train.max_steps} steps at the training's "
             f"batch), rungs at {', '.join(map(str, rungs(setup)))} images seen; sampler "
             f"{t.sampler.value} (seed {t.seed}), pruner {t.pruner.value} (reduction "
             f"{t.reduction}); budget {setup.limit.describe()}.",
             f"Spent: {seconds / 3600:.3g} device-hours, {steps} steps in {len(trials)} trials ("
             + ", ".join(f"{n} {k}" for k, n in counts.items() if n) + ").", ""]
    lines += _chosen(setup, best, again)
    lines += _importance_lines(study, setup)
    lines += ["## Best loss against device-hours", "", "| device-hours | best val loss | trial |",
              "|---|---|---|"]
    lines += [f"| {h:.4g} | {v:.6f} | {n} |" for h, v, n in anytime(trials)]
    lines += ["", "## Trials", "", *_table(study, setup), "",
              "![validation loss against wall-clock](quality.png)", ""]
    return "\n".join(lines)


def _spent(trials: list[Any]) -> tuple[float, int]:
    seconds = sum(float(x.user_attrs.get("device_s", 0.0)) for x in trials)
    steps = sum(int(x.user_attrs.get("steps", 0)) for x in trials)
    return seconds, steps


def _chosen(setup: Any, best: Any, again: dict[str, Any] | None) -> list[str]:
    if best is None:
        return ["**No trial ran to its end**: see each trial's message below.", ""]
    out = [f"**Chosen: trial {best.number}**, validation loss {best.value:.6f} after "
           f"{setup.last} images: " + ", ".join(f"`{a.override(best.params[a.key])}`"
                                                for a in setup.axes) + ".", "", "```",
           "python -m ds_trainer " + " ".join(line(setup, best.params)), "```", ""]
    if again is not None and again.get("val_loss") is not None:
        diff = again["val_loss"] - again["search_val_loss"]
        out += ["| | validation loss |", "|---|---|",
                f"| trial {best.number} in the search | {again['search_val_loss']:.6f} |",
                f"| the same, trained again from scratch | {again['val_loss']:.6f} |",
                f"| difference | {diff:+.6f} ({diff / again['search_val_loss']:+.2%}) |", "",
                f"The run again: {again['steps']} steps, {again['device_s'] / 3600:.3g} "
                "device-hours (not in the search's figures above).", ""]
    elif again is not None:
        out += [f"Trained again from scratch: {again['state']} ({again.get('message')}).", ""]
    return out


def _importance_lines(study: Any, setup: Any) -> list[str]:
    scores, n = importance(study, setup)
    if not scores:
        return [f"Importance of each axis: too few trials at the first rung ({n}).", ""]
    return ([f"## Importance of each axis (PED-ANOVA over {n} trials at {setup.rung} images)", "",
             "| axis | importance |", "|---|---|"]
            + [f"| {k} | {v:.3f} |" for k, v in scores.items()] + [""])


def table(study: Any, setup: Any) -> list[dict[str, Any]]:
    """Every trial's row, in the order they were asked."""
    trials = study.get_trials(deepcopy=False)
    start, attrs = _start(trials), study.user_attrs
    return [row(x, setup, start, attrs.get(f"lost_{x.number}")) for x in trials]


def _table(study: Any, setup: Any) -> list[str]:
    rows = table(study, setup)
    if not rows:
        return ["(no trial)"]
    keys = list(rows[0])
    return (["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            + ["| " + " | ".join(_cell(r[k]) for k in keys) + " |" for r in rows])


def _cell(value: Any) -> str:
    if isinstance(value, float) and 0 < abs(value) < 0.01:
        return f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:.6f}" if value < 100 else f"{value:.0f}"
    return fmt(value)


def to_wandb(study: Any, setup: Any, png: Path) -> None:
    """The study as a W&B table (and its chart), when the logger is W&B."""
    logger = setup.cfg.logger
    if logger.name.value != "wandb" or logger.mode.value == "disabled":
        return
    import wandb

    rows = table(study, setup)
    run = wandb.init(project=logger.project, entity=logger.entity, mode=logger.mode.value,
                     group=f"tune-{setup.cfg.tune.name}", job_type="tune",
                     name=f"quality tune {setup.cfg.tune.name}", dir=str(setup.tune_dir))
    keys: list[Any] = list(rows[0]) if rows else ["trial"]
    run.log({"quality": wandb.Table(columns=keys, data=[[r[k] for k in keys] for r in rows]),
             "quality_chart": wandb.Image(str(png))})
    run.finish()


def finish(study: Any, setup: Any, again: dict[str, Any] | None) -> int:
    """Write every output; 0 when a trial ran to its end, else 1."""
    from optuna.trial import TrialState

    d = setup.tune_dir
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = min(complete, key=lambda x: x.value) if complete else None
    rows = table(study, setup)
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (d / "quality.csv").write_text(buf.getvalue())
    chart(study, best, d / "quality.png")
    (d / "quality.md").write_text(markdown(study, setup, best, again))
    to_wandb(study, setup, d / "quality.png")
    if best is None:
        print(f"tune: no trial ran to its end; see {d / 'quality.md'}", file=sys.stderr)
        return 1
    chosen = line(setup, best.params)
    (d / "winner.txt").write_text(" ".join(chosen) + "\n")
    what = f"the quality tune's chosen trial {best.number}, validation loss {best.value:.6f}"
    preset = outputs.write_preset(setup.cfg, outputs.preset_text(setup.cfg, chosen, what), d)
    print("\n".join([f"tune: chosen trial {best.number}: validation loss {best.value:.6f}",
                     "  python -m ds_trainer " + " ".join(chosen),
                     f"  or: {outputs.apply_line(setup.cfg)}",
                     f"  report: {d / 'quality.md'} (quality.csv, quality.png beside it); "
                     f"preset: {preset}"]))
    return 0
