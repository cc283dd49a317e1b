"""precision=bf16_pure_kahan (precision.weight_update=kahan): bf16 weights whose small updates accumulate as fp32
masters' do, under DeepSpeed's bf16 masters and FSDP2's bf16 shards; its state, its checkpoints and a move into
another layout; refused where it cannot run.

Engines are built in this process on a one-rank gloo group, as test_deepspeed_engines does; one run and its resume
under FSDP2 go through the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.ranks import free_port, one_rank_process_group
from test_deepspeed_engines import SmallNet, written_config
from test_optimizers import _package

from ds_trainer.config import checks

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")

STEPS = 30


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    with one_rank_process_group(free_port()):
        yield


def _engine(tmp_path: Path, *overrides: str) -> tuple[Any, dict[str, Any]]:
    """A DeepSpeed engine over SmallNet as the recipe builds it (its own optimizer from the JSON, or ds_trainer's)."""
    from ds_trainer.train.optim import build

    overrides = ("scheduler=constant", "optimizer.lr=1e-4", "optimizer.weight_decay=0", *overrides)
    report = checks.check(make_cfg(f"paths.outputs={tmp_path}", *overrides))
    assert report.ok, report.render()
    ds = written_config(tmp_path, *overrides)
    torch.manual_seed(0)
    model = SmallNet()
    if "optimizer" in ds:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    else:
        optimizer = build.optimizer(report.cfg, list(model.parameters()))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine, ds


def _steps(engine: Any, ds: dict[str, Any], steps: int) -> list[float]:
    dtype = next(engine.module.parameters()).dtype
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(ds["train_micro_batch_size_per_gpu"], 64, generator=gen).to(dtype)
        loss = torch.nn.functional.mse_loss(engine(x).float(), x[:, :8].float().flip(0))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine: Any) -> torch.Tensor:
    """Every weight as the run has learned it: the master, and under Kahan summation its compensation added (what
    the portable state holds)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ds_trainer.train.state import kahan

    base = engine.optimizer.optimizer
    out = []
    for p in engine.module.parameters():
        comp = safe_get_full_optimizer_state(p, kahan.COMP) if kahan.is_kahan(base) and base.state else None
        out.append(kahan.with_compensation(safe_get_full_fp32_param(p), comp).flatten())
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["stage2", "stage3"])
def test_kahan_bf16_weights_move_as_fp32_masters_do_where_rounded_ones_stand_still(one_rank_group: None,
                                                                                    tmp_path: Path, zero: str) -> None:
    """At lr 1e-4 Adam's step is below half a bf16 unit of most of SmallNet's weights: bf16_pure rounds it away,
    the Kahan-compensated run moves as the fp32 masters of precision=bf16 do; its state is two bytes a parameter
    more than bf16_pure's, all bf16."""
    _package("optimi")
    start = None
    moved, state = {}, {}
    for precision in ("bf16", "bf16_pure", "bf16_pure_kahan"):
        engine, ds = _engine(tmp_path / precision, f"zero={zero}", f"precision={precision}")
        start = _weights(engine) if start is None else start
        _steps(engine, ds, STEPS)
        moved[precision] = _weights(engine) - start
        base = engine.optimizer.optimizer
        state[precision] = {key: (str(v.dtype), v.numel() * v.element_size()) for s in base.state.values()
                            for key, v in s.items() if torch.is_tensor(v) and v.numel() > 1}
        if precision == "bf16_pure_kahan":
            assert type(base).__module__.startswith("optimi") and base.param_groups[0]["step"] == STEPS
            _reloaded_continues(engine, ds, tmp_path / "saved", zero)
        engine.destroy()
    reference = moved["bf16"].abs().mean()
    off = {p: (moved[p] - moved["bf16"]).abs().mean() / reference for p in ("bf16_pure", "bf16_pure_kahan")}
    assert off["bf16_pure_kahan"] < 0.02 < 0.5 < off["bf16_pure"], off  # measured: 0.004 and 0.68
    kahan, pure = state["bf16_pure_kahan"], state["bf16_pure"]
    assert {dtype for dtype, _ in kahan.values()} == {"torch.bfloat16"} and set(kahan) - set(pure) == {"kahan_comp"}
    assert kahan["kahan_comp"][1] == pure["exp_avg"][1]  # one bf16 tensor the size of the partition: 2 bytes each


def _reloaded_continues(engine: Any, ds: dict[str, Any], folder: Path, zero: str) -> None:
    """DeepSpeed's own checkpoint of the Kahan run: a new engine loads its step count and compensation and takes the
    same next steps as the engine that saved it."""
    engine.save_checkpoint(str(folder), tag="t")
    again, _ = _engine(folder.parent / "again", f"zero={zero}", "precision=bf16_pure_kahan")
    again.load_checkpoint(str(folder), tag="t")
    assert again.optimizer.optimizer.param_groups[0]["step"] == STEPS
    assert _steps(again, ds, 2) == _steps(engine, ds, 2)
    assert torch.equal(_weights(again), _weights(engine))
    again.destroy()


@pytest.mark.slow
def test_a_kahan_run_resumes_under_fsdp2_from_its_learned_weights_and_step(tmp_path: Path) -> None:
    """ZeRO-2 with bf16_pure_kahan, then its step-2 checkpoint resumed under FSDP2: the portable state holds the
    learned weight (w + c) and the moments, the FSDP2 run's first step sees the same weights (the same loss) and its
    optimi AdamW counts on from step 2. (Both runs hold the UNet's attention to the math kernel.)"""
    _package("optimi")
    # train.attention=math in both: the UNet's attention held to one SDPA kernel under ZeRO-2 and FSDP2 alike
    args = ("precision=bf16_pure_kahan", "logger=none", "data.num_samples=8", "train.max_steps=4",
            "train.checkpoint_every=2", "train.export=false", "train.log_every=1", "train.attention=math")
    first = run_cli("zero=stage2", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "optimizer optimi.AdamW steps (a DeepSpeed client optimizer: ZeRO hands it each rank's flat partition)" \
        in first.stderr
    assert "attention: math kernel only, in 22 attention layers of the trained module" in first.stderr
    (run_a,) = run_dirs(tmp_path)
    saved = run_a / "checkpoints" / "step_00000002"
    meta = json.loads((saved / "portable" / "meta.json").read_text())
    assert (meta["optimizer_step"], meta["moments"], meta["layout"]["optimizer_kernel"]) == (2, True, "kahan")
    second = run_cli("zero=fsdp_full_shard", *args, f"resume={saved}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "carried fp32 weights and Adam moments (optimizer step 2) of 410/410 trainable parameters" in second.stderr
    run_b = next(d for d in run_dirs(tmp_path) if d != run_a)
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (run_a, run_b)]
    assert losses[1][0] == pytest.approx(losses[0][2], rel=1e-5)  # step 3 from the same weights
    assert losses[1][1] == pytest.approx(losses[0][3], rel=1e-2)  # step 4: FSDP2's reductions, bf16 gradients
    end = json.loads((run_b / "checkpoints" / "step_00000004" / "portable" / "meta.json").read_text())
    assert end["optimizer_step"] == 4


def test_the_step_count_of_an_optimizer_that_keeps_none_is_none_not_a_crash() -> None:
    """optimi's Lion counts no steps (its groups have no `step`): a bf16_pure_kahan run with optimizer=lion failed at
    its first checkpoint (the portable state asked for the count); AdamW's is its steps."""
    _package("optimi")
    import optimi

    from ds_trainer.train.state import kahan

    counts = {}
    for name, cls in (("lion", optimi.Lion), ("adamw", optimi.AdamW)):
        weight = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        base = cls([weight], lr=1e-3, kahan_sum=True)
        for _ in range(2):
            weight.grad = torch.full_like(weight, 0.1)
            base.step()
        counts[name] = kahan.step_count(base)
    assert counts == {"lion": None, "adamw": 2}


def test_a_weight_carried_into_a_bf16_kahan_module_keeps_what_its_rounding_lost() -> None:
    """A resume (or a fresh start's exact masters) into bf16 weights under optimi's Kahan summation, where the module
    holds the weights itself (DDP, FSDP2's shards): each weight is the carried fp32 rounded to bf16, and its
    compensation what that rounding lost, so weight + compensation is the carried value to bf16's next bits (the
    compensation was zero before: the lost part was dropped) and the moments are the carried ones."""
    _package("optimi")
    import optimi

    from ds_trainer.train.backends.params import Whole
    from ds_trainer.train.state import carry, kahan

    torch.manual_seed(0)
    model = SmallNet().to(torch.bfloat16)
    base = optimi.AdamW(model.parameters(), lr=1e-4, kahan_sum=True)
    saved = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
    values = {f"{kind}/{name}": value * scale for name, value in saved.items()
              for kind, scale in (("fp32", 1.0), ("exp_avg", 1e-3), ("exp_avg_sq", 1e-6))}
    carry.write(Whole(), model, base, values, set(saved), moments=True, t=2)  # a dict is a Source
    for name, p in model.named_parameters():
        state = base.state[p]
        assert torch.equal(p.detach(), saved[name].to(torch.bfloat16))
        assert state[kahan.COMP].abs().max() > 0, name
        learned = kahan.with_compensation(p.detach(), state[kahan.COMP])
        assert (learned - saved[name]).abs().max() < (saved[name] - p.detach().float()).abs().max() / 100
        assert torch.equal(state["exp_avg"], (saved[name] * 1e-3).to(torch.bfloat16))


@pytest.mark.parametrize("zero", ["stage2", "stage3", "fsdp_full_shard"])
def test_the_planner_counts_the_compensation_beside_bf16_pures_state(zero: str) -> None:
    """Two bytes a trained parameter more than bf16_pure, sharded as the optimizer state is (full and LoRA)."""
    from ds_trainer.tools import plan
    from ds_trainer.tools.plan.states import stats, trained_module

    for extra in ([], ["adapter=lora"]):
        cfgs = {p: make_cfg("model=sdxl_base", f"zero={zero}", f"precision={p}", *extra)
                for p in ("bf16_pure", "bf16_pure_kahan")}
        pure, compensated = (plan.estimate(cfg, zero, "none", 4) for cfg in cfgs.values())
        cfg = cfgs["bf16_pure"]
        _, trained = trained_module(cfg, stats(cfg).params)
        assert compensated.optimizer - pure.optimizer == 2 * trained // 4, extra
        assert (compensated.params, compensated.grads) == (pure.params, pure.grads)


@pytest.mark.parametrize(("overrides", "key", "fix"), [
    (["precision=bf16", "precision.weight_update=kahan"], "precision.weight_update=kahan", "precision=bf16_pure_kahan"),
    (["precision=bf16_pure_kahan", "optimizer=adagrad"], "optimizer.name=adagrad", "optimizer=adamw"),
    (["precision=bf16_pure_kahan", "zero=stage2", "offload=cpu"], "offload=cpu", "offload=none"),
    (["precision=bf16_pure_kahan", "zero=stage3", "offload=nvme"], "offload=nvme", "offload=none"),
    (["precision=bf16_pure_kahan", "zero=ddp"], "precision=bf16_pure", "zero=stage1"),
])
def test_kahan_where_it_cannot_run_gets_the_one_screen_message(overrides: list[str], key: str, fix: str) -> None:
    report = checks.check(make_cfg(*overrides))
    assert not report.ok
    shown = report.render()
    assert key in shown and fix in shown, shown


def test_the_kahan_optimizer_is_said_and_recorded_and_zero3_steps_it_once() -> None:
    report = checks.check(make_cfg("precision=bf16_pure_kahan", "zero=stage3", "optimizer=adamw_torch"))
    assert report.ok, report.render()
    assert report.cfg.resolved.optimizer == "adamw_kahan" and report.cfg.zero.sub_group_size >= 10**12
    said = " ".join(report.warnings)
    assert "steps as optimi.AdamW with Kahan summation" in said and "rounds away" not in said
    lion = checks.check(make_cfg("precision=bf16_pure_kahan", "zero=fsdp_full_shard", "optimizer=lion"))
    assert lion.ok and lion.cfg.resolved.optimizer == "lion_kahan", lion.render()
