"""The written ds_config.json builds a real DeepSpeed engine (CPU accelerator) that trains.

Engines are built in this process, one after another, on a one-rank gloo group: the same code path
as a real run, without paying DeepSpeed's import and op-loading time per case.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg
from helpers.deps import require
from helpers.ranks import free_port, one_rank_process_group
from omegaconf import OmegaConf

from ds_trainer import cli
from ds_trainer.config import checks, nvme, optimizers

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    with one_rank_process_group(free_port()):
        yield


class SmallNet(torch.nn.Module):
    """Two layers above ZeRO-3's persistence threshold, so stage 3 really partitions (and swaps) them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(64, 512)
        self.hidden = torch.nn.Linear(512, 512)
        self.out = torch.nn.Linear(512, 8)

    def forward(self, x: Any) -> Any:
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def written_config(tmp_path: Path, *overrides: str) -> dict[str, Any]:
    cfg = make_cfg(f"paths.outputs={tmp_path}", "train.max_steps=5", "optimizer.lr=1e-3", *overrides)
    checked, ds = cli.prepare(cfg, tmp_path / "run")
    cli.write_files(checked, ds, tmp_path / "run", OmegaConf.to_yaml(cfg))  # what a run writes, once checked
    return json.loads((tmp_path / "run" / "ds_config.json").read_text())


def train_steps(ds: dict[str, Any], steps: int = 5) -> tuple[Any, list[float]]:
    torch.manual_seed(0)
    model = SmallNet()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(ds["train_micro_batch_size_per_gpu"], 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    target = torch.randn(x.shape[0], 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(engine(x).float(), target.float())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def valid_cases() -> list[tuple[str, str, str]]:
    cases = []
    for zero in ("stage0", "stage1", "stage2", "stage3"):
        for offload in ("none", "cpu", "nvme"):
            for precision in ("bf16", "fp16", "fp32"):
                cases.append((zero, offload, precision))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "offload", "precision"), valid_cases())
def test_zero_offload_precision_engine_trains(tmp_path: Path, zero: str, offload: str, precision: str) -> None:
    overrides = (f"zero={zero}", f"offload={offload}", f"precision={precision}", "scheduler=constant")
    report = checks.check(make_cfg(f"paths.outputs={tmp_path}", *overrides))
    if not report.ok:
        # Invalid here: the only reasons are offload below stage 1 and fp16 without kernels.
        keys = {p.key for p in report.problems}
        assert (zero == "stage0" and offload != "none" and keys <= {"offload", "precision"}) or \
               (precision == "fp16" and "precision" in keys), report.render()
        return
    if report.cfg.resolved.optimizer_state_on == "nvme":
        require(nvme.aio_prerequisites() is None, "libaio-dev is not installed")
    ds = written_config(tmp_path, *overrides)
    engine, losses = train_steps(ds)
    assert losses[-1] < losses[0], losses
    assert engine.zero_optimization_stage() == int(zero[-1])
    if report.cfg.resolved.params_on == "nvme":
        swapped = list(Path(ds["zero_optimization"]["offload_param"]["nvme_path"]).rglob("*.swp"))
        assert swapped, "ZeRO-3 NVMe offload wrote no swap files"
    engine.destroy()


@pytest.mark.slow
# DeepSpeed's own optimizers, built from the JSON; the ones ds_trainer builds itself (adamw_torch, adamw8bit, prodigy,
# schedule_free_adamw) are handed to the engine as client optimizers: tests/test_optimizers.py.
@pytest.mark.parametrize("optimizer", sorted(p.stem for p in (Path(__file__).parent.parent / "conf" / "optimizer")
                                             .glob("*.yaml") if not optimizers.is_client(p.stem)))
def test_every_optimizer_trains_or_is_refused(tmp_path: Path, optimizer: str) -> None:
    # On a CPU-only machine Lion runs as DeepSpeed's CPU Lion, which needs offload. Muon is refused for a full UNet (its
    # 4-D convolution weights; tests/test_bad_overrides.py) and trains matrices such as LoRA's, which this small net
    # of Linear layers stands for.
    offload = "cpu" if optimizer == "lion" else "none"
    overrides = (f"optimizer={optimizer}", f"offload={offload}", "scheduler=constant",
                 *(("adapter=lora",) if optimizer == "muon" else ()))
    report = checks.check(make_cfg(f"paths.outputs={tmp_path}", *overrides))
    if not report.ok:
        assert optimizer == "lamb" and report.problems[0].key == "optimizer.name", report.render()
        assert "CUDA" in report.problems[0].why
        return
    engine, losses = train_steps(written_config(tmp_path, *overrides))
    assert losses[-1] < losses[0], losses
    engine.destroy()


@pytest.mark.slow
@pytest.mark.parametrize(("scheduler", "ds_type"), [
    ("warmup", "WarmupLR"), ("warmup_decay", "WarmupDecayLR"), ("warmup_cosine", "WarmupCosineLR"),
    ("one_cycle", "OneCycle"), ("constant", None)])
def test_every_scheduler_drives_the_lr(tmp_path: Path, scheduler: str, ds_type: str | None) -> None:
    ds = written_config(tmp_path, f"scheduler={scheduler}", "scheduler.warmup_steps=2")
    engine, _ = train_steps(ds)
    lr = engine.get_lr()[0]
    if ds_type is None:
        assert engine.lr_scheduler is None and lr == pytest.approx(1e-3)
    else:
        assert type(engine.lr_scheduler).__name__ == ds_type
        if scheduler in ("warmup_decay", "warmup_cosine"):
            assert 0 <= lr < 1e-3  # decaying towards the end of train.max_steps
        if scheduler == "warmup":
            assert lr == pytest.approx(1e-3)  # warmed up and holding
    engine.destroy()


def optimizer_state_bytes(engine: Any) -> tuple[set[str], int, set[str]]:
    """(dtypes, bytes) of the optimizer's moment tensors, and the dtypes of DeepSpeed's master partitions."""
    zero = engine.optimizer
    state = [v for s in zero.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    masters = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
    return ({str(v.dtype) for v in state}, sum(v.numel() * v.element_size() for v in state),
            {str(m.dtype) for m in masters})


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "offload"), [("stage1", "cpu"), ("stage2", "none"), ("stage3", "cpu")])
def test_bf16_pure_keeps_masters_and_adam_state_in_bf16_at_half_the_bytes(tmp_path: Path, zero: str,
                                                                          offload: str) -> None:
    """DeepSpeed's own bf16 masters, gradients and moments (FusedAdam, or its CPU Adam under offload with
    fp32_optimizer_states=False): the optimizer state takes half the bytes of precision=bf16's, and it trains."""
    measured = {}
    for precision in ("bf16", "bf16_pure"):
        overrides = (f"zero={zero}", f"offload={offload}", f"precision={precision}", "scheduler=constant")
        ds = written_config(tmp_path / precision, *overrides)
        engine, losses = train_steps(ds)
        assert losses[-1] < losses[0] / 5, (precision, losses)
        measured[precision] = optimizer_state_bytes(engine)
        engine.destroy()
    (pure_dtypes, pure_bytes, pure_masters), (dtypes, full_bytes, masters) = measured["bf16_pure"], measured["bf16"]
    assert pure_dtypes == pure_masters == {"torch.bfloat16"} and dtypes == masters == {"torch.float32"}
    assert pure_bytes * 2 == full_bytes
