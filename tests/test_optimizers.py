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
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs, terminal_chatter
from helpers.ranks import free_port, one_rank_process_group
from test_deepspeed_engines import SmallNet, written_config

from ds_trainer.config import checks

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")


def _package(name: str) -> Any:
    """A dependency of the README's setup: missing in CI is a failure, elsewhere a skip."""
    if os.environ.get("CI") == "true":
        import importlib
        return importlib.import_module(name)
    return pytest.importorskip(name)



@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group for the engines built in this process (not for the runs it starts: they make their
    own)."""
    with one_rank_process_group(free_port()):
        yield


def _train(tmp_path: Path, *overrides: str) -> tuple[Any, list[float], dict[str, Any]]:
    from ds_trainer.train.optim import build

    report = checks.check(make_cfg(f"paths.outputs={tmp_path}", "scheduler=constant", "optimizer.lr=1e-3",
                                       *overrides))
    assert report.ok, report.render()
    ds = written_config(tmp_path, "scheduler=constant", *overrides)
    torch.manual_seed(0)
    model = SmallNet()
    if "optimizer" in ds:  # DeepSpeed's own, from its JSON (the baseline)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    else:  # as the recipe builds it
        optimizer = build.optimizer(report.cfg, list(model.parameters()))
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
    bnb = _package("bitsandbytes")
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
    report = checks.check(make_cfg(*overrides))
    if not report.ok:
        return "refused: " + report.problems[0].key
    name = report.cfg.resolved.optimizer
    return "runs" if name == overrides[0].split("=")[1] else f"runs as {name}"


PACKAGES = {"adamw8bit": "bitsandbytes", "adamw_torch": "torch", "prodigy": "prodigyopt",
            "schedule_free_adamw": "schedulefree"}


@pytest.mark.parametrize("optimizer", list(PACKAGES))
def test_every_offload_and_backend_runs_the_client_optimizer_as_named_or_refuses(optimizer: str) -> None:
    _package(PACKAGES[optimizer])
    cells = [(zero, offload, 1) for zero in ("ddp", "stage0", "stage1", "stage2", "stage3", "fsdp_full_shard")
             for offload in ("none", "cpu", "nvme")]
    cells += [(zero, offload, 2) for zero in ("ddp", "stage0", "stage2", "stage3") for offload in ("none", "cpu")]
    got = {(zero, offload, ranks): _rule([f"optimizer={optimizer}", f"zero={zero}", f"offload={offload}",
                                          f"world_size={ranks}"]) for zero, offload, ranks in cells}
    for key, rule in got.items():
        assert rule == "runs" or rule.startswith("refused"), (key, rule)  # never another optimizer
    assert got["stage3", "nvme", 1] == "refused: offload"  # DeepSpeed swaps only its own optimizers' state
    assert got["stage2", "cpu", 1] == got["stage3", "cpu", 1] == got["ddp", "none", 2] == "runs"
    assert got["stage0", "none", 2] == "runs"  # every rank holds every parameter
    refused_under_fsdp = optimizer in ("adamw8bit", "prodigy", "schedule_free_adamw")
    assert got["fsdp_full_shard", "none", 1] == ("refused: optimizer.name" if refused_under_fsdp else "runs")
    # Prodigy's d needs sums over every rank's partition, an all-reduce prodigyopt runs on CUDA only.
    sharded = "refused: optimizer.name" if optimizer == "prodigy" else "runs"
    assert got["stage2", "none", 2] == got["stage3", "cpu", 2] == sharded


def test_schedule_free_refuses_a_decaying_schedule_and_global_state_takes_one_zero3_sub_group() -> None:
    _package("schedulefree")
    report = checks.check(make_cfg("optimizer=schedule_free_adamw", "scheduler=warmup_cosine"))
    assert [(p.key, p.value) for p in report.problems] == [("scheduler", "warmup_cosine")]
    assert "scheduler=warmup" in report.problems[0].fix
    report = checks.check(make_cfg("optimizer=prodigy", "zero=stage3", "optimizer.lr=1e-4"))
    assert report.ok and report.cfg.zero.sub_group_size >= 10**12
    said = " ".join(report.warnings)
    assert "sub_group_size raised from 1000000000" in said and "10000 times slower" in said


def _offloaded_run(cwd: Path, *overrides: str, optimizer: str = "adamw8bit") -> tuple[Path, str]:
    """One rank (test_portable's 8-bit chain runs two): ZeRO-2 with the state offloaded, through Accelerate."""
    cwd.mkdir(parents=True, exist_ok=True)
    result = run_cli(f"optimizer={optimizer}", "zero=stage2", "offload=cpu", "precision=fp32", "logger=none",
                     "data.num_samples=8", "train.max_steps=4", "train.checkpoint_every=2", "train.export=false",
                     *overrides, cwd=cwd, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir, result.stderr


@pytest.mark.slow
def test_8bit_adamw_through_accelerate_with_offload_trains_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    _package("bitsandbytes")
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


def _reference(tmp_path: Path, steps: int, *overrides: str) -> tuple[Any, Any, list[float]]:
    """The same optimizer on the same model and data in plain torch (fp32, no DeepSpeed), clipped as DeepSpeed clips:
    what the optimizer's authors' code does unsharded."""
    from ds_trainer.train.optim import build

    report = checks.check(make_cfg(f"paths.outputs={tmp_path}", "scheduler=constant", "optimizer.lr=1e-3",
                                       "precision=fp32", *overrides))
    ds = written_config(tmp_path, "scheduler=constant", "precision=fp32", *overrides)
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = build.optimizer(report.cfg, list(model.parameters()))
    x = torch.randn(ds["train_micro_batch_size_per_gpu"], 64, generator=torch.Generator().manual_seed(1))
    target = torch.randn(x.shape[0], 8, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        if ds.get("gradient_clipping"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), ds["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, optimizer, losses


def _whole(engine: Any) -> dict[str, Any]:
    """The module's weights as a forward sees them (gathered under ZeRO-3), in fp32."""
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=hasattr(next(engine.module.parameters()), "ds_id")):
        return {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}


@pytest.mark.parametrize(("zero", "offload"), [("stage0", "none"), ("stage2", "cpu"), ("stage3", "none")])
def test_schedule_free_samples_and_exports_its_evaluation_weights_under_zero(one_rank_group: None, tmp_path: Path,
                                                                           zero: str, offload: str) -> None:
    """The weights samples and exports use are what the library's own `eval()` gives unsharded, under every ZeRO
    stage (its `eval()` under ZeRO would move only the flat masters, or nothing under ZeRO-3); afterwards training
    goes on from exactly where it was."""
    schedulefree = _package("schedulefree")
    from ds_trainer.train.backends.params import Zero
    from ds_trainer.train.optim import schedule_free

    overrides = ("optimizer=schedule_free_adamw", f"zero={zero}", f"offload={offload}", "precision=fp32")
    engine, losses, _ = _train(tmp_path, *overrides)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    assert type(base) is schedulefree.AdamWScheduleFree and losses[-1] < losses[0] / 3, losses
    reference, ref_optimizer, ref_losses = _reference(tmp_path / "ref", len(losses), *overrides)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    y = _whole(engine)
    ref_optimizer.eval()  # the library's own evaluation weights, unsharded
    x_ref = {name: p.detach().clone() for name, p in reference.named_parameters()}
    with schedule_free.moved(engine.module, base, Zero(lambda: engine, int(zero[-1])).masters(base)):
        x = _whole(engine)
    after = _whole(engine)
    for name in y:
        moved_by = (x_ref[name] - y[name]).abs().max().item()
        assert moved_by > 1e-4, name  # x is not y: the check below can tell them apart
        assert (x[name] - x_ref[name]).abs().max().item() < moved_by / 100, name
        assert torch.equal(after[name], y[name]), name  # back at y bit for bit
    engine.destroy()


@pytest.mark.parametrize("zero", ["stage2", "stage3"])
def test_prodigy_estimates_the_same_step_size_from_zero_partitions_as_unsharded(one_rank_group: None, tmp_path: Path,
                                                                              zero: str) -> None:
    """Prodigy's d sums over every parameter: ZeRO's flat partition (one rank, one ZeRO-3 sub-group) gives the d
    of the unsharded optimizer, and d grows from d0 as it should (without the safeguarded warm-up that the defaults
    for long diffusion runs have, under which d hardly moves in five steps)."""
    prodigyopt = _package("prodigyopt")
    overrides = ("optimizer=prodigy", "optimizer.lr=1.0", "optimizer.safeguard_warmup=false",
                 "optimizer.use_bias_correction=false", f"zero={zero}", "precision=fp32")
    engine, losses, ds = _train(tmp_path, *overrides)
    if zero == "stage3":
        assert ds["zero_optimization"]["sub_group_size"] >= 10**12  # one step() call sees every parameter
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    assert type(base) is prodigyopt.Prodigy and losses[-1] < losses[0], losses
    _, ref_optimizer, ref_losses = _reference(tmp_path / "ref", len(losses), *overrides)
    d, d_ref = base.param_groups[0]["d"], ref_optimizer.param_groups[0]["d"]
    assert d > 10 * base.param_groups[0]["d0"] and d == pytest.approx(d_ref, rel=1e-4), (d, d_ref)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    state = _state(engine)
    assert {"exp_avg", "exp_avg_sq", "p0", "s"} <= set(state), state
    engine.destroy()


def test_the_planner_counts_each_optimizers_state() -> None:
    """Per trained parameter beside the fp32 master (4 bytes): Adam's and schedule-free's two fp32 tensors (8),
    Prodigy's four at slice_p=1 (16) and three at slice_p=2, 8-bit AdamW's two bytes and block scales."""
    from ds_trainer.tools import plan

    def state(*overrides: str) -> float:
        report = checks.check(make_cfg("model=sdxl_tiny", *overrides))
        assert report.ok, report.render()
        adam = plan.estimate(checks.check(make_cfg("model=sdxl_tiny", "optimizer=adamw")).cfg, "stage2", "none", 1)
        return plan.estimate(report.cfg, "stage2", "none", 1).optimizer / (adam.optimizer / 12)

    assert state("optimizer=schedule_free_adamw") == pytest.approx(12)
    assert state("optimizer=prodigy") == pytest.approx(20)
    assert state("optimizer=prodigy", "optimizer.slice_p=2") == pytest.approx(16)
    assert state("optimizer=adamw8bit") == pytest.approx(4 + 2 + 8 / 256)


@pytest.mark.slow
def test_prodigy_through_accelerate_with_offload_steps_as_itself_and_resumes_its_step_size(tmp_path: Path) -> None:
    """Accelerate would make Prodigy DeepSpeed's CPU Adam at lr 1.0 under offload; here it steps as itself, quietly
    (prodigyopt prints on construction), and its per-step state, kept in its param groups (the step count and the
    sums behind d), survives a native resume: the resumed steps repeat the uninterrupted run's losses exactly."""
    _package("prodigyopt")
    extra = ("optimizer.safeguard_warmup=false", "optimizer.use_bias_correction=false", "scheduler=constant")
    first, stderr = _offloaded_run(tmp_path / "first", *extra, optimizer="prodigy")
    assert "optimizer prodigyopt.Prodigy steps (a DeepSpeed client optimizer" in stderr
    assert terminal_chatter(stderr) == []

    def group(run_dir: Path, step: int) -> dict[str, Any]:
        """Prodigy's per-step state: its step count and the sums behind d (d itself leaves d0 later on a UNet)."""
        folder = run_dir / "checkpoints" / f"step_{step:08d}" / "pytorch_model"
        (states,) = folder.glob("*zero_pp_rank_0_*optim_states.pt")
        saved = torch.load(states, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        return {k: saved["base_optimizer_state"]["param_groups"][0][k] for k in ("k", "d", "d_numerator", "d_hat")}

    assert group(first, 2)["k"] == 2 and group(first, 4)["d_numerator"] > group(first, 2)["d_numerator"] > 0
    rows = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    resumed, _ = _offloaded_run(tmp_path / "resumed", *extra, f"resume={first / 'checkpoints' / 'step_00000002'}",
                                optimizer="prodigy")
    again = {r["step"]: r["loss"] for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())}
    assert again == {r["step"]: r["loss"] for r in rows if r["step"] > 2}
    assert group(resumed, 4) == group(first, 4)


# CI budget: the evaluation weights under ZeRO-3 are checked by default in process
# (test_schedule_free_samples_and_exports_its_evaluation_weights_under_zero).
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.multiproc
def test_schedule_free_lora_on_two_zero3_ranks_samples_and_exports_its_evaluation_weights(tmp_path: Path) -> None:
    """Under ZeRO-3 on two ranks the sample and the exported LoRA are the evaluation weights x (not the training
    point y the checkpoint keeps): the sample equals the base pipeline with the exported LoRA loaded, and that
    LoRA differs from the checkpoint's weights."""
    from safetensors.torch import load_file
    from test_portable import portable_state
    from test_sampling import _from_export, _image, _torchrun

    _package("schedulefree")
    result = _torchrun(tmp_path, "optimizer=schedule_free_adamw", "adapter=lora", "precision=fp32",
                       "scheduler=constant", "optimizer.lr=1e-2", "logger=none", "samples=on", "samples.every=0",
                       "samples.seeds=[3]", "samples.prompts=[a small house]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer schedulefree.AdamWScheduleFree steps" in result.stderr
    (run_dir,) = run_dirs(tmp_path)
    got = _image(run_dir / "samples" / "step_00000004" / "0_3.png")
    assert (got == _from_export(run_dir, "a small house", 3, lora=run_dir / "lora")).all()
    exported = load_file(str(run_dir / "lora" / "pytorch_lora_weights.safetensors"))
    _, state = portable_state(run_dir / "checkpoints" / "step_00000004")
    y = {"unet." + k.removeprefix("fp32/").replace(".default.", ".").replace("lora_A", "lora.down")
         .replace("lora_B", "lora.up"): v for k, v in state.items() if k.startswith("fp32/")}
    assert y.keys() == exported.keys()
    pairs = [(exported[key], y[key]) for key in y]
    moved = max((x.float() - w).abs().max().item() for x, w in pairs)
    assert moved > 1e-4, moved  # x = y + (1 - 1/beta1)(z - y), z ahead of y by lr-sized steps


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_torch"])
def test_nothing_to_train_is_one_message_before_any_optimizer_is_built(optimizer: str) -> None:
    """An empty parameter list would fail deep in DeepSpeed (an empty flat buffer) or torch (an empty group)."""
    from ds_trainer.errors import TrainingError
    from ds_trainer.train import backends
    from ds_trainer.train.optim import build

    cfg = checks.check(make_cfg(f"optimizer={optimizer}", "adapter=lora")).cfg
    ds = {"optimizer": {"params": {"lr": 1e-4}}} if optimizer == "adamw" else None
    with pytest.raises(TrainingError, match="no parameter left to train") as caught:
        build.for_run(cfg, backends.of(cfg, ds), [])
    assert "adapter.targets" in str(caught.value)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget (62 s): 8-bit AdamW on two ranks (ZeRO-2) and carried into ZeRO-3 runs in test_portable
def test_8bit_adamw_trains_lora_on_two_zero3_ranks(tmp_path: Path) -> None:
    """A real run beside the in-process engines: bitsandbytes' 8-bit AdamW on ZeRO-3 partitions of two ranks (LoRA),
    its uint8 state in the checkpoint; it steps as named, the loss falls. (torch's AdamW stepping a LoRA under DDP:
    test_quantize's int8 run.)"""
    from test_sampling import _torchrun

    _package("bitsandbytes")
    result = _torchrun(tmp_path / "zero3", "optimizer=adamw8bit", "adapter=lora", "precision=fp32",
                       "scheduler=constant", "optimizer.lr=1e-2", "logger=none", "train.checkpoint_every=4",
                       "train.export=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer bitsandbytes.optim.AdamW8bit steps (a DeepSpeed client optimizer" in result.stderr
    (run_dir,) = run_dirs(tmp_path / "zero3")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    files = sorted((run_dir / "checkpoints" / "step_00000004" / "pytorch_model").glob("*optim_states.pt"))
    assert len(files) == 2  # one partition per rank
    for states in files:
        saved = torch.load(states, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        quantized = [s["__bnb_optimizer_quant_state__"] for s in saved["optimizer_state_dict"]["state"].values()]
        assert quantized and {str(q[k].dtype) for q in quantized for k in ("state1", "state2")} == {"torch.uint8"}


@pytest.mark.parametrize("name", ["adafactor", "CAME"])
def test_a_factored_optimizer_is_refused_with_why_its_factorisation_is_lost_under_zero(name: str) -> None:
    report = checks.check(make_cfg(f"optimizer.name={name}", "zero=stage2"))
    assert [(p.key, p.value) for p in report.problems] == [("optimizer.name", name)]
    problem = report.problems[0]
    assert "factored" in problem.why and "flat 1-D partitions" in problem.why
    assert "optimizer=adamw8bit" in problem.fix


# CI budget (150 s): Muon trains by default in test_deepspeed_engines' engine array, its compile set-up in
# test_startup.
@pytest.mark.long
@pytest.mark.slow
def test_muon_trains_lora_under_zero3_without_reduce_scatter(tmp_path: Path) -> None:
    """DeepSpeed's Muon on what it can train here: LoRA's adapters (matrices), ZeRO-3 with reduce-scatter off (what
    validation asks for; a full UNet is refused, tests/test_bad_overrides.py). Its Newton-Schulz functions compile at
    their first call (train/imports.py defers torch.compile's set-up): the run steps, and LoRA's B matrices, zero
    at the start, have moved."""
    from safetensors.torch import load_file

    result = run_cli("optimizer=muon", "adapter=lora", "zero=stage3", "zero.reduce_scatter=false", "logger=none",
                     "data.num_samples=4", "train.max_steps=3", "train.checkpoint_every=0",
                     "train.final_checkpoint=false", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["optimizer"]["type"] == "Muon" and ds["zero_optimization"]["reduce_scatter"] is False
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    weights = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    b_matrices = [w for key, w in weights.items() if "lora_B" in key or "lora.up" in key]
    assert b_matrices and all(float(w.abs().max()) > 0 for w in b_matrices)
