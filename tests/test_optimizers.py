"""The optimizers ds_trainer builds itself (torch's AdamW, bitsandbytes' 8-bit AdamW): each steps as named under
every backend and offload, or is refused; none runs as another.

Engines are built in this process on a one-rank gloo group (DeepSpeed's CPU accelerator), as test_deepspeed_engines
does; one run goes through Accelerate, where the swap to DeepSpeed's CPU Adam would happen, and resumes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, make_cfg, one_rank_process_group, run_cli, run_dirs
from test_deepspeed_engines import SmallNet, written_config

from ds_trainer.config import validation

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")


def _bitsandbytes() -> Any:
    if os.environ.get("CI") == "true":  # a dependency of the README's setup: missing in CI is a failure
        import bitsandbytes
        return bitsandbytes
    return pytest.importorskip("bitsandbytes")


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group for the engines built in this process (not for the runs it starts: they make their
    own)."""
    with one_rank_process_group(free_port()):
        yield


def _train(tmp_path: Path, *overrides: str) -> tuple[Any, list[float], dict[str, Any]]:
    from ds_trainer.train import recipe

    report = validation.check(make_cfg(f"paths.outputs={tmp_path}", "scheduler=constant", "optimizer.lr=1e-3",
                                       *overrides))
    assert report.ok, report.render()
    ds = written_config(tmp_path, "scheduler=constant", *overrides)
    torch.manual_seed(0)
    model = SmallNet()
    if "optimizer" in ds:  # DeepSpeed's own, from its JSON (the baseline)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    else:  # as the recipe builds it
        optimizer = recipe._torch_optimizer(report.cfg, list(model.parameters()))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(ds["train_micro_batch_size_per_gpu"], 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    target = torch.randn(x.shape[0], 8, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(engine(x).float(), target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses, ds


def _state(engine: Any) -> dict[str, tuple[set[str], int]]:
    """The optimizer's state tensors by key: their dtypes and bytes."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out: dict[str, tuple[set[str], int]] = {}
    for state in base.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.numel() > 1:
                dtypes, size = out.get(key, (set(), 0))
                out[key] = (dtypes | {str(value.dtype)}, size + value.numel() * value.element_size())
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "offload"), [("stage0", "none"), ("stage1", "cpu"), ("stage2", "none"),
                                               ("stage3", "cpu")])
def test_8bit_adamw_steps_as_named_under_zero_and_offload_with_uint8_moments(one_rank_group: None, tmp_path: Path,
                                                                              zero: str, offload: str) -> None:
    bnb = _bitsandbytes()
    engine, losses, ds = _train(tmp_path, "optimizer=adamw8bit", f"zero={zero}", f"offload={offload}")
    assert "optimizer" not in ds and "scheduler" not in ds  # the real optimizer is handed over, not a JSON block
    assert ds.get("zero_force_ds_cpu_optimizer", True) is (offload == "none")  # no CPU Adam put in its place
    assert losses[-1] < losses[0] / 3, losses
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    assert type(base) is bnb.optim.AdamW8bit
    state = _state(engine)
    # Per tensor (ZeRO-0) bitsandbytes keeps tensors below its min_8bit_size (4096: the biases) in 32 bits; under ZeRO
    # it sees one flat partition, all of it 8-bit (the semantic change the README documents).
    expected = {"torch.uint8", "torch.float32"} if zero == "stage0" else {"torch.uint8"}
    assert state["state1"][0] == state["state2"][0] == expected, state
    # Against fp32 Adam on the same model and layout: the moments take a quarter of the bytes (plus the absmax
    # per block of 256), here under ZeRO's flat partitions too.
    engine.destroy()
    adam, _, _ = _train(tmp_path / "adam", "optimizer=adamw", f"zero={zero}", f"offload={offload}")
    fp32 = sum(size for key, (_, size) in _state(adam).items() if key in ("exp_avg", "exp_avg_sq"))
    eight = sum(size for key, (_, size) in state.items() if key in ("state1", "state2", "absmax1", "absmax2"))
    assert eight < 0.27 * fp32, (eight, fp32)
    adam.destroy()


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "offload"), [("stage2", "cpu"), ("stage3", "none")])
def test_torch_adamw_is_handed_to_deepspeed_as_itself(one_rank_group: None, tmp_path: Path, zero: str,
                                                      offload: str) -> None:
    engine, losses, ds = _train(tmp_path, "optimizer=adamw_torch", f"zero={zero}", f"offload={offload}")
    assert "optimizer" not in ds and losses[-1] < losses[0] / 3, losses
    assert type(getattr(engine.optimizer, "optimizer", engine.optimizer)) is torch.optim.AdamW
    assert _state(engine)["exp_avg"][0] == {"torch.float32"}
    engine.destroy()


def _rule(overrides: list[str]) -> str:
    report = validation.check(make_cfg(*overrides))
    if not report.ok:
        return "refused: " + report.problems[0].key
    name = report.cfg.resolved.optimizer
    return "runs" if name == overrides[0].split("=")[1] else f"runs as {name}"


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw_torch"])
def test_every_offload_and_backend_runs_the_client_optimizer_as_named_or_refuses(optimizer: str) -> None:
    _bitsandbytes()
    got = {(zero, offload): _rule([f"optimizer={optimizer}", f"zero={zero}", f"offload={offload}"])
           for zero in ("ddp", "stage0", "stage1", "stage2", "stage3", "fsdp_full_shard")
           for offload in ("none", "cpu", "nvme")}
    for (zero, offload), rule in got.items():
        assert rule == "runs" or rule.startswith("refused"), (zero, offload, rule)  # never another optimizer
    assert got["stage3", "nvme"] == "refused: offload"  # DeepSpeed swaps only its own optimizers' state
    assert got["stage2", "cpu"] == got["stage3", "cpu"] == got["ddp", "none"] == "runs"
    assert got["fsdp_full_shard", "none"] == ("refused: optimizer.name" if optimizer == "adamw8bit" else "runs")


def _offloaded_run(cwd: Path, *overrides: str) -> tuple[Path, str]:
    """One rank (test_portable's 8-bit chain runs two): ZeRO-2 with the state offloaded, through Accelerate."""
    cwd.mkdir(parents=True, exist_ok=True)
    result = run_cli("optimizer=adamw8bit", "zero=stage2", "offload=cpu", "precision=fp32", "logger=none",
                     "data.num_samples=8", "train.max_steps=4", "train.checkpoint_every=2", "train.export=false",
                     *overrides, cwd=cwd, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir, result.stderr


@pytest.mark.slow
def test_8bit_adamw_through_accelerate_with_offload_trains_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    _bitsandbytes()
    first, stderr = _offloaded_run(tmp_path / "first")
    # Accelerate would have put DeepSpeed's CPU Adam in its place under offload; the run checks what steps.
    assert "optimizer bitsandbytes.optim.AdamW8bit steps (a DeepSpeed client optimizer" in stderr
    saved = first / "checkpoints" / "step_00000002"
    (states,) = (saved / "pytorch_model").glob("*zero_pp_rank_0_*optim_states.pt")
    base = torch.load(states, map_location="cpu", weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
    quantized = [s["__bnb_optimizer_quant_state__"] for s in base["state"].values()]  # bitsandbytes' own layout
    assert quantized and {str(q[k].dtype) for q in quantized for k in ("state1", "state2")} == {"torch.uint8"}
    rows = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    resumed, stderr = _offloaded_run(tmp_path / "resumed", f"resume={saved}")
    assert "another configuration" not in stderr
    again = {r["step"]: (r["loss"], r["lr"]) for r in map(json.loads, (resumed / "metrics.jsonl").read_text()
                                                           .splitlines())}
    assert again == {r["step"]: (r["loss"], r["lr"]) for r in rows if r["step"] > 2}
