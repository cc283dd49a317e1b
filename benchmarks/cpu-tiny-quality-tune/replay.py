"""The quality search replayed many times on a measured landscape: how often it finds the grid's best.

    .venv/bin/python benchmarks/cpu-tiny-quality-tune/replay.py
    .venv/bin/python benchmarks/cpu-tiny-quality-tune/replay.py --read <tune dir> [<tune dir> ...]

One real search is one draw: its sampler's seed decides where it looks. This replays the search
thousands of times at no training cost, on the tiny SDXL's planted landscape (the long test of
tests/test_tune_quality.py) as measured by real trials, to say how often a search of a given budget
ends within the noise of the full grid's best cell, on one worker and on two.

- The landscape: planted.csv, every trial of real tunes on the planted folder (the full grid of 9
  learning rates x ranks 1, 4, 16, and real searches): its rank, learning rate and validation loss
  at the rung (72 images, step 12) and at its end (216, step 36). Between measured learning rates a
  rank's loss is interpolated, linearly in log loss over log learning rate, and each replayed trial
  draws noise of half the measured noise (the best cell's loss with its learning rate x 0.97 and
  x 1.03) at the rung and at its end. `--read` rebuilds planted.csv from tune folders.
- The search is the product's own parts: tools/tune/study.py's sampler (TPE, multivariate, constant
  liar, a seed per worker) and step budget (a trial starts only if its steps fit beside those spent
  and held), its random trials first (quality.startup_trials), tools/tune/halving.py's pruner, and
  trial.Watch following each run (its reports, its wait at a rung, its pruning). Each trial runs
  one step a tick beside the others; a validation is read after the next step (the tune's reads).
- Out: replay.md, for each budget (a share of the grid's 972 steps) and each number of workers:
  the share of seeds whose chosen trial is within twice the noise of the grid's best (its true,
  noise-free loss), the median of that loss, the trials and steps a search ran.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE / "planted.csv"
GRID_STEPS, GRID_BEST, NOISE = 972, 0.278777, 0.010139  # the long test's grid, measured
MAX_STEPS, RUNG_STEP, IMAGES_PER_STEP = 36, 12, 6
RANKS = (1, 4, 16)


@dataclass(frozen=True)
class Point:
    rank: int
    lr: float
    losses: dict[int, float]  # step: validation loss (a pruned trial's stop short of the end)


def read_tunes(folders: list[Path]) -> list[Point]:
    """Every trial of the tunes' journals that validated at least once."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    points = []
    for folder in folders:
        storage = JournalStorage(JournalFileBackend(str(folder / "study.journal")))
        for summary in optuna.get_all_study_summaries(storage):
            study = optuna.load_study(study_name=summary.study_name, storage=storage)
            for t in study.trials:
                if not t.intermediate_values or "repeat_of" in t.user_attrs:
                    continue
                losses = {images // IMAGES_PER_STEP: float(v)
                          for images, v in t.intermediate_values.items()}
                points.append(Point(int(t.params["adapter.rank"]), float(t.params["optimizer.lr"]),
                                    losses))
    return points


def write(points: list[Point]) -> None:
    steps = sorted({s for p in points for s in p.losses})
    with DATA.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["rank", "lr", *(f"loss_at_step_{s}" for s in steps)])
        for p in sorted(points, key=lambda p: (p.rank, p.lr)):
            out.writerow([p.rank, f"{p.lr:.6g}",
                          *(f"{p.losses[s]:.6f}" if s in p.losses else "" for s in steps)])


def load() -> list[Point]:
    with DATA.open() as f:
        return [Point(int(r.pop("rank")), float(r.pop("lr")),
                      {int(k.rsplit("_", 1)[1]): float(v) for k, v in r.items() if v})
                for r in csv.DictReader(f)]


class Landscape:
    """A rank's validation loss at a step, between the measured learning rates."""

    def __init__(self, points: list[Point]) -> None:
        self.points = points
        self.curves: dict[tuple[int, int], tuple[list[float], list[float]]] = {}

    def loss(self, rank: int, lr: float, step: int) -> float:
        import numpy as np

        if (rank, step) not in self.curves:
            at: dict[float, list[float]] = {}  # a learning rate measured twice: the mean
            for p in self.points:
                if p.rank == rank and step in p.losses:
                    at.setdefault(p.lr, []).append(math.log(p.losses[step]))
            lrs = sorted(at)
            self.curves[rank, step] = ([math.log10(x) for x in lrs],
                                       [sum(at[x]) / len(at[x]) for x in lrs])
        xs, ys = self.curves[rank, step]
        return float(np.exp(np.interp(math.log10(lr), xs, ys)))


def tune_cfg(seed: int, sampler: str) -> Any:
    from omegaconf import OmegaConf

    from ds_trainer.config.tool_groups import TuneConfig

    return OmegaConf.merge(OmegaConf.structured(TuneConfig), {"objective": "quality", "seed": seed,
                                                               "sampler": sampler})


def search(land: Landscape, seed: int, workers: int, budget: int, rungs: int,  # noqa: PLR0913
           sampler: str = "tpe") -> dict[str, Any]:
    """One search: the product's sampler and pruner, trials stepping side by side."""
    import numpy as np
    import optuna
    from optuna.trial import TrialState

    from ds_trainer.tools.tune import quality
    from ds_trainer.tools.tune import study as shared
    from ds_trainer.tools.tune import trial as trials
    from ds_trainer.tools.tune.halving import ReachedHalving

    noise = np.random.default_rng(seed * 1009 + workers)
    storage = optuna.storages.InMemoryStorage()
    at = [MAX_STEPS // 3**k for k in range(rungs, 0, -1)]  # the rungs' steps
    space = {"optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 1, log=True),
             "adapter.rank": optuna.distributions.CategoricalDistribution(list(RANKS))}
    limit = shared.Budget(None, budget, None)
    startup = quality.startup_trials(None, len(space), limit.afforded(MAX_STEPS))
    studies = [optuna.create_study(study_name="replay", storage=storage, load_if_exists=True,
                                   sampler=shared.sampler(tune_cfg(seed, sampler), [], startup, w),
                                   pruner=ReachedHalving(at[0] * IMAGES_PER_STEP, 3))
               for w in range(workers)]
    plan = trials.Plan([], IMAGES_PER_STEP, MAX_STEPS, at[0], 1)
    running: list[Run | None] = [None] * workers
    ended = [False] * workers
    while not all(ended):
        for w, study in enumerate(studies):
            if running[w] is not None or ended[w]:
                continue
            if shared.over(study, limit, MAX_STEPS):
                ended[w] = True
            elif not shared.waits(study, limit, MAX_STEPS):
                trial = study.ask(space)
                for key, value in (("worker", w), ("max_steps", MAX_STEPS), ("steps", 0)):
                    trial.set_user_attr(key, value)
                rank, lr = trial.params["adapter.rank"], trial.params["optimizer.lr"]
                losses = {step: land.loss(rank, lr, step) + noise.normal(0, NOISE / 2)
                          for step in (*at, MAX_STEPS)}
                gate = partial(study.pruner.waits, study, number=trial.number)  # quality._gate's
                running[w] = Run(trials.Watch(trial, plan, float("inf"), gate), losses)
        if all(r is None for r in running):
            break  # the rest wait on nothing: the budget is spent
        for w, study in enumerate(studies):
            r = running[w]
            if r is not None and r.advance(study):
                running[w] = None
    trials = storage.get_all_trials(studies[0]._study_id)
    chosen = min((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    true = land.loss(chosen.params["adapter.rank"], chosen.params["optimizer.lr"], MAX_STEPS)
    return {"true": true, "within": true <= GRID_BEST + 2 * NOISE, "trials": len(trials),
            "steps": sum(int(t.user_attrs["steps"]) for t in trials)}


@dataclass
class Run:
    """A replayed trial's run, followed by the product's trial.Watch (its reports, its wait at a
    rung, its pruning) as the tune follows metrics.jsonl: `read` and `step` are a Follower's, and
    a validation written at a step is read after the next one, as the tune's reads come between
    steps."""

    watch: Any
    losses: dict[int, float]  # step: validation loss, the end's included
    step: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)  # written, not yet read

    def read(self) -> list[dict[str, Any]]:
        rows, self.rows = self.rows, []
        return rows

    def advance(self, study: Any) -> bool:
        """One step and a read; True when the trial ended (told) or was pruned."""
        from optuna.trial import TrialState

        trial, self.step = self.watch.trial, self.step + 1
        trial.set_user_attr("steps", self.step)
        if self.step == MAX_STEPS:
            study.tell(trial, self.losses[MAX_STEPS])
            return True
        if self.watch.progress(self):
            study.tell(trial, state=TrialState.PRUNED)
            return True
        if self.step in self.losses:
            self.rows.append({"step": self.step, "val_loss": self.losses[self.step]})
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read", nargs="+", type=Path, help="tune folders: rebuild planted.csv")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--shares", nargs="+", type=float, default=[1 / 3, 1 / 2, 2 / 3])
    parser.add_argument("--samplers", nargs="+", default=["tpe", "random"])
    parser.add_argument("--rungs", nargs="+", type=int, default=[1], help="tune.rungs: 1, at step 12; "
                        "2, at steps 4 and 12 (the landscape needs losses measured there)")
    args = parser.parse_args()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    if args.read:
        write(read_tunes(args.read))
    land = Landscape(load())
    lines = ["# The quality search replayed on the planted landscape", "",
             f"{args.seeds} seeds a row; `replay.py` says how. Within: the chosen trial's loss (noise-free, "
             f"interpolated) at most the grid's best {GRID_BEST} + 2 x {NOISE}.", "",
             "| budget (of the grid's 972 steps) | rungs | sampler | workers | within | median loss chosen "
             "| trials | steps |", "|---|---|---|---|---|---|---|---|"]
    for share in args.shares:
        budget = int(GRID_STEPS * share) - (1 if share == 1 / 3 else 0)  # the long test's: under a third
        for rungs, sampler, workers in ((n, s, w) for n in args.rungs for s in args.samplers
                                        for w in (1, 2)):
            runs = [search(land, 10 * i, workers, budget, rungs, sampler)
                    for i in range(args.seeds)]
            lines.append(f"| {budget} ({share:.0%}) | {rungs} | {sampler} | {workers} | "
                         f"{sum(r['within'] for r in runs) / len(runs):.0%} | "
                         f"{statistics.median(r['true'] for r in runs):.4f} | "
                         f"{statistics.mean(r['trials'] for r in runs):.1f} | "
                         f"{statistics.mean(r['steps'] for r in runs):.0f} |")
            print(lines[-1], flush=True)
    (HERE / "replay.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
