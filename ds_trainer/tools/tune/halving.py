"""Successive halving over the trials that reached a rung (`tune.pruner=halving`).

Optuna's SuccessiveHalvingPruner compares a trial at a rung with those it has already ruled on
there, so the first trial to reach a rung is always promoted, and one that waits for the others
is still compared with none of them. This pruner keeps its rule (at a rung the best
1/`reduction` go on; while fewer than `reduction` have reached it, only the best so far) over
every trial that has reported at the rung: running, ended or pruned, not failed ones (a failed
trial's parameters run again) nor repeats of another's result. With the quality tune's wait at a
rung (trial.Watch) a trial is ruled on beside those that ran at the same time.
"""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial, TrialState


class ReachedHalving(optuna.pruners.BasePruner):
    """Rungs at `first` x `reduction`^k images seen; lower values are better."""

    def __init__(self, first: int, reduction: int) -> None:
        self.first, self.reduction = first, reduction

    def is_rung(self, images: int) -> bool:
        at = self.first
        while at < images:
            at *= self.reduction
        return at == images

    def prune(self, study: optuna.study.Study, trial: FrozenTrial) -> bool:
        images = trial.last_step
        if images is None or not self.is_rung(images):
            return False
        value = trial.intermediate_values[images]
        return value > self.bar(study, images, trial.number, value)

    def bar(self, study: optuna.study.Study, images: int, number: int, value: float) -> float:
        """The value a trial at this rung must reach to go on."""
        reached = [t for t in _others(study, number) if images in t.intermediate_values]
        values = sorted([value, *(t.intermediate_values[images] for t in reached)])
        return values[max(0, len(values) // self.reduction - 1)]

    def waits(self, study: optuna.study.Study, images: int, number: int) -> bool:
        """Whether trial `number` at `images` waits for the trials running short of it: a rung
        that fewer than `reduction` have reached while another is on its way (trial.Watch)."""
        if not self.is_rung(images):
            return False
        there = coming = 0
        for other in _others(study, number):
            if images in other.intermediate_values:
                there += 1
            elif other.state == TrialState.RUNNING and "worker" in other.user_attrs:
                coming += 1
        return coming > 0 and there + 1 < self.reduction


def _others(study: optuna.study.Study, number: int) -> list[FrozenTrial]:
    """The trials a rung counts beside trial `number`: running, ended or pruned, not repeats."""
    counted = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)
    return [t for t in study.get_trials(deepcopy=False, states=counted)
            if t.number != number and "repeat_of" not in t.user_attrs]
