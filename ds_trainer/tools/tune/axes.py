"""The quality tune's axes: the overrides a user gives as sweeps, each an Optuna distribution.

`optimizer.lr=tag(log,interval(1e-5,1e-3))` is a float on a log scale, `adapter.rank=4,8,16` (or
`choice(4,8,16)`) a categorical, `range(2,9,2)` an integer with its step, `tag(int,interval(4,64))`
an integer; a group's options (`optimizer=adamw,adamw8bit`) are categoricals. That is the syntax of
Hydra's sweeps and of hydra-optuna-sweeper. An axis the search cannot take is refused on one screen:
what decides the measure (the validation set, the model, the length of a trial, the seed), what does
not change the loss (the layout: ZeRO, offload, checkpointing, compile; those are the speed tune's),
a range on a group's names, a log scale through zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_trainer.config.problems import Problem

# (key prefixes, why a search cannot take them, the fix)
_MEASURE = "every trial is compared by one measure"
REFUSED: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("validation",), f"{_MEASURE}: the validation set, its timesteps, noise and schedule "
     "(validation.every is the first rung)", "set it once, as a plain override"),
    (("data", "resolution", "model", "text_encoders.pretrained"), f"{_MEASURE}: another model, "
     "resolution or data gives a loss of another validation set or scale", "tune each apart"),
    (("train.max_steps",), "every trial's length is train.max_steps, the last rung",
     "train.max_steps=<the length of a full trial>"),
    (("train.seed",), "a trial's seed is recorded, not searched: the best of several seeds is luck",
     "train.seed=<one seed>"),
    (("zero", "offload", "train.gradient_checkpointing", "train.compile", "train.attention"),
     "the layout does not change the validation loss (docs/validation-loss.md), only speed and "
     "memory", "search it with tune.objective=speed"),
    (("world_size", "logger", "paths", "hydra", "tune", "plan", "resume", "dry_run", "samples",
      "platform", "export", "cache_only"), "it is not a training choice the loss depends on",
     "give it once, as a plain override"),
)
GROUPS = ("optimizer", "scheduler", "precision", "adapter", "quantize", "text_encoders")


@dataclass(frozen=True)
class Axis:
    """One searched override: its key (the trial's parameter name) and its distribution."""

    key: str
    given: str
    distribution: Any  # an optuna.distributions.BaseDistribution

    def override(self, value: Any) -> str:
        """The training override that sets this axis to `value`."""
        if isinstance(value, bool):
            return f"{self.key}={str(value).lower()}"
        return f"{self.key}={value}"

    def values(self) -> list[Any]:
        """The values to check before the search: a categorical's choices, an interval's ends."""
        d = self.distribution
        if hasattr(d, "choices"):
            return list(d.choices)
        return [d.low, d.high]


def _refusal(key: str) -> tuple[str, str] | None:
    for prefixes, why, fix in REFUSED:
        if any(key == p or key.startswith(p + ".") for p in prefixes):
            return why, fix
    return None


class _Refused(Exception):
    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.why)
        self.problem = problem


def _categorical(key: str, choices: list[Any], given: str) -> Any:
    from optuna.distributions import CategoricalDistribution

    plain = [c for c in choices if c is None or isinstance(c, bool | int | float | str)]
    if len(plain) != len(choices) or len(set(map(repr, choices))) != len(choices):
        raise _Refused(Problem(key, given, "each choice must be one plain value, given once",
                               f"{key}=a,b,c"))
    return CategoricalDistribution(choices)


def _interval(key: str, sweep: Any, given: str) -> Any:
    from optuna.distributions import FloatDistribution, IntDistribution

    low, high, tags = sweep.start, sweep.end, set(sweep.tags)
    log = "log" in tags
    if not low < high:
        raise _Refused(Problem(key, given, f"the interval's low end ({low}) is not below its high "
                               f"end ({high})", f"{key}='interval(<low>,<high>)'"))
    if log and low <= 0:
        raise _Refused(Problem(key, given, "a log scale needs a positive low end",
                               f"{key}='tag(log,interval({high / 1000:g},{high:g}))'"))
    if "int" in tags or (isinstance(low, int) and isinstance(high, int)):
        return IntDistribution(int(low), int(high), log=log)
    return FloatDistribution(float(low), float(high), log=log)


def _range(key: str, sweep: Any, given: str) -> Any:
    from optuna.distributions import FloatDistribution, IntDistribution

    start, stop, step = sweep.start, sweep.stop, sweep.step or 1
    count = int((stop - start) / step - 1e-9) + 1 if step > 0 and stop > start else 0
    if count >= 2 and all(isinstance(v, int) for v in (start, stop, step)):
        return IntDistribution(start, start + (count - 1) * step, step=step)
    if count >= 2:
        return FloatDistribution(start, start + (count - 1) * step, step=step)
    raise _Refused(Problem(key, given, "the range holds fewer than two values",
                           f"{key}='range(<start>,<stop>,<step>)'"))


def axis(raw: str, parsed: Any) -> Axis:
    """The axis of one sweep override (raises _Refused with the problem when it cannot be one)."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    key, given = raw.split("=", 1)[0], raw.split("=", 1)[1]
    name = key.lstrip("+~")
    refused = _refusal(name)
    if refused is not None:
        raise _Refused(Problem(name, given, f"cannot be a quality axis: {refused[0]}", refused[1]))
    value = parsed.value()
    if isinstance(value, ChoiceSweep):
        return Axis(key, given, _categorical(name, list(value.list), given))
    if name in GROUPS:
        raise _Refused(Problem(name, given, "a group's options are names: a choice, not a range",
                               f"{name}=<option>,<option>"))
    if isinstance(value, IntervalSweep):
        return Axis(key, given, _interval(name, value, given))
    if isinstance(value, RangeSweep):
        return Axis(key, given, _range(name, value, given))
    raise _Refused(Problem(name, given, "not a choice, interval or range",
                           f"{name}=a,b or {name}='tag(log,interval(low,high))'"))


def split(argv: list[str]) -> tuple[list[str], list[Axis], list[Problem]]:
    """(the training overrides, the axes, the problems) of a quality tune's command line: a sweep
    override is an axis, every other override is the training's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    base, found, problems = [], [], []
    for raw in argv:
        try:
            (parsed,) = parser.parse_overrides([raw])
        except OverrideParseException:
            base.append(raw)  # Hydra's own check says what is wrong with it
            continue
        if not parsed.is_sweep_override():
            base.append(raw)
            continue
        try:
            found.append(axis(raw, parsed))
        except _Refused as refused:
            problems.append(refused.problem)
    return base, found, problems


def corners(argv: list[str]) -> list[list[str]]:
    """The command lines a search spans at its axes' ends (each choice, an interval's two ends),
    one axis at a time beside the others' first values: what the docs' checks compose."""
    base, found, _ = split(argv)
    first = [a.override(a.values()[0]) for a in found]
    lines = [[*base, *first]]
    for i, a in enumerate(found):
        for value in a.values()[1:]:
            lines.append([*base, *first[:i], a.override(value), *first[i + 1:]])
    return lines
