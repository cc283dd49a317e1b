"""Checkpoints that resume anywhere: another ZeRO stage, DDP, offload, number of ranks and batch split.

One chain of runs shares the work: a reference run of M steps (checkpoint every step), and runs that
each resume from an earlier run's checkpoint under another configuration and train to step M, with the
same global batch (2) and seed (so each pair A -> B is "2N steps under A" against "N under A, then
under B", the reference standing for A: all layouts compute the same steps up to summation order).
Every resumed run must match the reference at every step it trains (step count, LR, samples seen,
loss) and at step M (fp32 weights, Adam moments, step counts, EMA). A LoRA chain does the same with
the adapters. The ZeRO-3 NVMe run also checks DeepSpeed's NVMe training itself: without ds_trainer's
aligned gradient read (train/nvme_swap.py) its largest weight was 1e-4 off the reference after 4 steps.

Tolerances: the runs differ only in floating-point summation order (gradients reduced over 2 ranks or
accumulated over 2 micro-batches, DeepSpeed's Adam kernels vs torch.optim.AdamW). Weights and moments are
compared by their mean absolute difference (tests/helpers/numerics.py has why, and the figures): the largest single
difference is not bounded by the layout's noise on every CPU (Adam turns summation-order noise in near-zero
gradients into learning-rate-sized steps), the mean is, and a lost moment, a skipped or repeated step or sample,
or a wrong LR moves it by orders of magnitude more.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import numerics
from helpers.cli import run_cli, run_dirs
from helpers.deps import require
from helpers.ranks import torchrun

from ds_trainer.config import nvme

torch = pytest.importorskip("torch")

M = 6
COMMON = ["precision=fp32", "logger=none", "data.num_samples=8", "train.export=false", "train.checkpoint_every=1",
          f"train.checkpoints_to_keep={M}", f"scheduler.warmup_steps={M}", "train.ema=true", f"train.max_steps={M}",
          # Validation at 0 (a run that starts there), 3 and M; after step 3's checkpoint, so a run resumed from it
          # continues what the run that validated trained: a validation that did not put the weights back fails it.
          # Its 4 (image, timestep) pairs in one forward per rank: the split over ranks is what is checked.
          "validation=on", "validation.at_start=true", "validation.every=3", "validation.batch_size=4"]
LORA = ("adapter=lora",)
BF16 = ("precision=bf16",)
# torch's AdamW built by ds_trainer (a DeepSpeed client optimizer; on ZeRO-0 with bf16 DeepSpeed's
# FP16_UnfusedOptimizer keeps an fp32 master per parameter, and the moments on it).
TORCH_BF16 = ("precision=bf16", "optimizer=adamw_torch")
# bitsandbytes' 8-bit AdamW: its moments are written dequantized and quantized again in the new layout's blocks.
EIGHT_BIT = ("optimizer=adamw8bit",)
# name: (zero, offload, ranks, micro, accumulation, resumes from (run, step), extra overrides); the global batch
# is 2 throughout. Runs start when a selected test needs them (with the runs they resume from). Each run is
# compared with the reference of its kind: the full UNet's, or the LoRA adapters'.
REFERENCES = {(): "stage0", LORA: "lora_stage0", BF16: "bf16_stage2", TORCH_BF16: "bf16_stage2"}
CHAIN: dict[str, tuple[str, str, int, int, int, tuple[str, int] | None, tuple[str, ...]]] = {
    "stage0": ("stage0", "none", 1, 2, 1, None, ()),
    "stage2_x2": ("stage2", "none", 2, 1, 1, ("stage0", 1), ()),
    "ddp": ("ddp", "none", 1, 1, 2, ("stage2_x2", 2), ()),
    "stage3_cpu": ("stage3", "cpu", 1, 2, 1, ("ddp", 3), ()),
    "stage1": ("stage1", "none", 1, 2, 1, ("ddp", 3), ()),
    "stage3_x2": ("stage3", "none", 2, 1, 1, ("stage1", 4), ()),
    "stage1_after_stage3_x2": ("stage1", "none", 1, 2, 1, ("stage3_x2", 5), ()),
    # The optimizer state on NVMe (ZeRO-3 swaps it to disk), carried in and out again.
    "stage3_nvme": ("stage3", "nvme", 1, 2, 1, ("stage2_x2", 2), ()),
    "stage2_after_stage3_nvme": ("stage2", "none", 1, 2, 1, ("stage3_nvme", 4), ()),
    # DeepSpeed -> PyTorch FSDP2 -> DeepSpeed: ZeRO-2's state into FSDP's sharded DTensors on two ranks, and out
    # again into ZeRO-3.
    "fsdp_full_shard_x2": ("fsdp_full_shard", "none", 2, 1, 1, ("stage2_x2", 2), ()),
    "stage3_after_fsdp": ("stage3", "none", 1, 2, 1, ("fsdp_full_shard_x2", 4), ()),
    # LoRA: only the adapters train; their weights and moments carry the same way.
    "lora_stage0": ("stage0", "none", 1, 2, 1, None, LORA),
    "lora_stage3_x2": ("stage3", "none", 2, 1, 1, ("lora_stage0", 2), LORA),
    "lora_fsdp_shard_grad_op_x2": ("fsdp_shard_grad_op", "none", 2, 1, 1, ("lora_stage0", 2), LORA),
    # bf16: ZeRO-0 keeps the fp32 masters and Adam state in one flat tensor per group (FP16_Optimizer).
    "bf16_stage2": ("stage2", "none", 1, 2, 1, None, BF16),
    "bf16_stage0": ("stage0", "none", 1, 2, 1, ("bf16_stage2", 2), BF16),
    "bf16_stage2_after_stage0": ("stage2", "none", 1, 2, 1, ("bf16_stage0", 4), BF16),
    # DeepSpeed's AdamW -> torch's AdamW as a client optimizer: the same moments, another optimizer's state.
    "bf16_adamw_torch_stage0": ("stage0", "none", 1, 2, 1, ("bf16_stage2", 3), TORCH_BF16),
    # 8-bit AdamW, ZeRO-2 on two ranks -> ZeRO-3 with offload on one (its own test below).
    "adamw8bit_stage2_x2": ("stage2", "none", 2, 1, 1, None, EIGHT_BIT),
    "adamw8bit_stage3_cpu": ("stage3", "cpu", 1, 2, 1, ("adamw8bit_stage2_x2", 2), EIGHT_BIT),
}
REFERENCE = REFERENCES[()]


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def train(cwd: Path, zero: str, offload: str, ranks: int, micro: int, accum: int, *extra: str,
          ) -> subprocess.CompletedProcess[str]:
    args = [f"zero={zero}", f"offload={offload}", f"train.micro_batch_size={micro}",
            f"train.gradient_accumulation_steps={accum}", *COMMON, *extra]
    cwd.mkdir(parents=True, exist_ok=True)
    if ranks == 1:
        return run_cli(*args, cwd=cwd, timeout=1800)
    cmd = [*torchrun(ranks), "-m", "ds_trainer", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)


class Chain:
    """The runs of CHAIN, each trained the first time a test asks for it (after the run it resumes from)."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}  # type: ignore[var-annotated]

    def __getitem__(self, name: str) -> tuple[Path, str]:
        if name not in self.done:
            zero, offload, ranks, micro, accum, source, kind = CHAIN[name]
            if offload == "nvme":
                require(nvme.aio_prerequisites() is None, "libaio-dev is not installed")
            extra = [*kind, *([f"resume={ckpt(self[source[0]][0], source[1])}"] if source else [])]
            result = train(self.root / name, zero, offload, ranks, micro, accum, *extra)
            assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
            (run_dir,) = run_dirs(self.root / name)
            self.done[name] = (run_dir, result.stderr)
        return self.done[name]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def chain(module_tmp: Callable[[str], Path]) -> Chain:
    return Chain(module_tmp("chain"))


def metrics(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in row}


def validations(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in row}


def portable_state(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted((folder / "portable").glob("state-*.safetensors")):
        tensors.update(load_file(shard))
    return json.loads((folder / "portable" / "meta.json").read_text()), tensors


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str,
                      moments: float = 1e-3) -> None:
    """Weights by their mean absolute difference, moments by theirs over their scale (see tests/helpers/numerics.py: the
    largest single difference is no measure on every CPU; the mean separates noise from a lost state)."""
    assert got.keys() == expected.keys(), what
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        keys = [k for k in expected if k.startswith(kind + "/")]
        assert keys, f"{what}: no {kind} in the portable state"
        pair = ({k: got[k] for k in keys}, {k: expected[k] for k in keys})
        if kind == "fp32":
            numerics.assert_same_weights(*pair, f"{what} {kind}")
        else:
            numerics.assert_same_moments(*pair, f"{what} {kind}", tolerance=moments)


# Moves whose counterparts the default suite checks (ZeRO-3 x2 -> ZeRO-1 x1 beside FSDP x2 -> ZeRO-3 x1; bf16
# ZeRO-0 -> ZeRO-2 beside ZeRO-2 -> ZeRO-0; ZeRO-1 -> ZeRO-3 x2 beside ZeRO-2 x2 -> FSDP x2; a LoRA into FSDP's
# shard-grad-op x2 beside a LoRA into ZeRO-3 x2; torch's AdamW as a client beside DeepSpeed's in the 8-bit and
# optimizer tests): `make test-long`.
LONG = {"stage1_after_stage3_x2", "bf16_stage2_after_stage0", "stage3_x2", "lora_fsdp_shard_grad_op_x2",
        "bf16_adamw_torch_stage0", "stage3_after_fsdp",
        # CI budget (230 s): ZeRO-3 with offload carried into (beside ZeRO-3 x2 with LoRA, ZeRO-3 with NVMe), bf16's
        # ZeRO-0 masters (beside bf16 in the matrix's cells and bf16_pure's engine tests)
        "stage3_cpu", "bf16_stage0",
        # CI budget (about 50 s): NVMe's state carried out again (beside the carry into it, and ZeRO-3's state out of
        # another tool's checkpoint in the import test below)
        "stage2_after_stage3_nvme",
        # CI budget (94 s): a LoRA carried into ZeRO-3 on two ranks (beside test_lycoris' LoKr carried out of two ZeRO-3
        # ranks into ZeRO-2, by default)
        "lora_stage3_x2"}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n in LONG else n for n, spec in
                                  CHAIN.items() if spec[5] is not None and spec[6] != EIGHT_BIT])
def test_resume_under_another_configuration_continues_the_run(chain: Chain, name: str) -> None:
    zero, offload, ranks, micro, accum, (source, step), kind = CHAIN[name]  # type: ignore[misc]
    reference, _ = chain[REFERENCES[kind]]
    run_dir, stderr = chain[name]
    assert "under another configuration" in stderr and "Adam moments" in stderr, stderr[-2000:]
    if ranks > 1:  # each rank keeps a slice of the EMA; the comparison below shows the values are the same
        assert f"sharded over {ranks} ranks: rank 0 keeps and updates" in stderr
    expected, got = metrics(reference), metrics(run_dir)
    assert sorted(got) == list(range(step + 1, M + 1))  # the same step count, continuing after the checkpoint
    # The first step after the switch starts from the carried state: the same loss as the source run's step.
    first = step + 1
    assert got[first]["loss"] == pytest.approx(metrics(chain[source][0])[first]["loss"], rel=1e-4)
    for s in got:
        assert got[s]["lr"] == expected[s]["lr"], f"LR at step {s}"
        # bf16: runs drift apart by rounding whatever the layout (measured 1.6e-4 of the loss by step 5).
        rel = 1e-3 if "precision=bf16" in kind else 1e-4
        assert got[s]["loss"] == pytest.approx(expected[s]["loss"], rel=rel), f"loss at step {s}"
    meta, _ = portable_state(ckpt(run_dir, M))
    ref_meta, _ = portable_state(ckpt(reference, M))
    assert (meta["step"], meta["optimizer_step"], meta["samples"]) == (M, M, 2 * M)
    assert (ref_meta["step"], ref_meta["optimizer_step"], ref_meta["samples"]) == (M, M, 2 * M)
    assert meta["layout"]["zero"] == zero and meta["layout"]["world_size"] == ranks
    # fp32: the state at step M against the reference's. bf16: rounding drifts runs apart by up to 2e-4 on
    # weights over 4 steps whatever the layout, so the carry is checked one step after it, against the
    # source run's same step (the same state, data and bf16 weights; measured 1e-7 on the weights, 4e-4 of the
    # moments' scale, where a lost moment is off by ~90% of it).
    against, at, moments = (chain[source][0], first, 1e-2) if "precision=bf16" in kind else (reference, M, 1e-3)
    _, state = portable_state(ckpt(run_dir, at))
    _, expected_state = portable_state(ckpt(against, at))
    assert_same_state(state, expected_state, f"{source} -> {name}", moments=moments)
    ema, ref_ema = (torch.load(ckpt(r, at) / "ema.pt", weights_only=True) for r in (run_dir, against))
    assert ema["step"] == ref_ema["step"] == at
    # The EMA follows the module's weights (under bf16 a few of those round one bf16 ulp apart: 771 of 5.4M
    # elements, up to 7e-5 by step 5); its mean difference is as small as the weights'.
    numerics.assert_same_weights(ema["shadow"], ref_ema["shadow"], f"{source} -> {name} EMA")


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_validation_loss_is_the_same_number_under_every_layout(chain: Chain) -> None:
    # The chain's runs hold the same weights at the same step up to summation order, whatever their layout:
    # their validation losses must agree as closely. At step 0 the weights are the very same: one rank of
    # ZeRO-0 against two ranks of ZeRO-2, each rank scoring its share of the pairs.
    reference = validations(chain[REFERENCE][0])
    two_ranks = validations(chain["adamw8bit_stage2_x2"][0])
    assert sorted(reference) == [0, 3, M]
    assert two_ranks[0]["val_loss"] == pytest.approx(reference[0]["val_loss"], rel=1e-6)
    # Two evaluations of the same weights on one layout agree exactly: at step 0 the EMA is the weights (a float32
    # UNet on the EMA for the full UNet; the EMA adapters put into the live UNet for a LoRA).
    for name in (REFERENCE, "lora_stage0"):
        at_start = validations(chain[name][0])[0]
        assert at_start["val_loss_ema"] == at_start["val_loss"], name
    assert reference[M]["val_loss"] < reference[0]["val_loss"]  # it falls as the model learns
    assert reference[M]["val_loss_ema"] != reference[M]["val_loss"]
    for name in ("stage2_x2", "ddp", "fsdp_full_shard_x2"):  # (a LoRA's: `make test-long`, below)
        _assert_same_validation(chain, name)


def _assert_same_validation(chain: Chain, name: str) -> None:
    _, _, _, _, _, (_, start), kind = CHAIN[name]  # type: ignore[misc]
    expected, got = validations(chain[REFERENCES[kind]][0]), validations(chain[name][0])
    assert sorted(got) == [s for s in (3, M) if s > start], name  # a resumed run continues the schedule
    for s in got:
        for key in ("val_loss", "val_loss_ema"):
            assert got[s][key] == pytest.approx(expected[s][key], rel=1e-5), f"{name} {key} at step {s}"
    summary = json.loads((chain[name][0] / "summary.json").read_text())
    assert summary["val_loss"] == got[M]["val_loss"] and summary["val_loss_step"] == M


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget: lora_stage3_x2 is a long cell of the chain
def test_a_lora_carried_into_zero3_validates_as_its_reference(chain: Chain) -> None:
    """The adapters put into the live UNet for the validation, on two ZeRO-3 ranks after a carry: the same number."""
    _assert_same_validation(chain, "lora_stage3_x2")


# Measured one step after the move (fp32 weights, 8-bit AdamW, 2 ranks ZeRO-2 -> 1 rank ZeRO-3 with offload): m
# 1.07% and v 0.52% of their scale off the source's (1.6% and 0.8% three steps on); lost moments 75% and 67%.
MOVED_8BIT = (0.03, 0.03)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget: 8-bit AdamW's checkpoints resume in test_optimizers by default
def test_8bit_adamw_moments_move_to_another_layout_within_the_quantization_error(chain: Chain) -> None:
    source, _ = chain["adamw8bit_stage2_x2"]
    run_dir, stderr = chain["adamw8bit_stage3_cpu"]
    assert "under another configuration" in stderr and "8-bit moments quantized again" in stderr, stderr[-2000:]
    first = 3
    assert metrics(run_dir)[first]["loss"] == pytest.approx(metrics(source)[first]["loss"], rel=1e-4)
    meta, state = portable_state(ckpt(run_dir, first))
    _, expected = portable_state(ckpt(source, first))
    _, before = portable_state(ckpt(source, first - 1))
    assert meta["moments"] and meta["identity"]["optimizer"] == "adamw8bit" and state.keys() == expected.keys()
    numerics.assert_same_weights({k: v for k, v in state.items() if k.startswith("fp32/")},
                                 {k: v for k, v in expected.items() if k.startswith("fp32/")}, "8-bit carry weights")
    # One step after the move, against the source's same step: each moment was quantized in other blocks (2 ranks'
    # flat partitions -> one rank's), within MOVED_8BIT of its scale; lost moments would be far outside it.
    for kind, beta, tolerance in (("exp_avg", 0.9, MOVED_8BIT[0]), ("exp_avg_sq", 0.999, MOVED_8BIT[1])):
        keys = [k for k in expected if k.startswith(kind + "/")]
        got, want = {k: state[k] for k in keys}, {k: expected[k] for k in keys}
        numerics.assert_same_moments(got, want, f"8-bit {kind}", tolerance=tolerance)
        lost = {k: expected[k] - beta * before[k] for k in keys}  # what a fresh optimizer's first step holds
        assert numerics.mean_abs_difference(lost, want) > 5 * tolerance * numerics.mean_abs(want), kind


def convert(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*map(str, args), cwd=cwd, module="ds_trainer.convert")


@pytest.mark.slow
@pytest.mark.multiproc
def test_another_optimizer_or_architecture_is_refused_before_the_run(chain: Chain,
                                                                     tmp_path: Path) -> None:
    saved = ckpt(chain[REFERENCE][0], 4)
    for change, key in (("optimizer=adagrad", "optimizer=adagrad"),
                        ("model=sdxl_base", "model.architecture=sdxl_base")):
        result = run_cli(f"resume={saved}", change, "dry_run=true", *COMMON, cwd=tmp_path)
        assert result.returncode == 2, result.stderr[-2000:]
        assert key in result.stderr and "resume_optimizer=reset" in result.stderr
        assert "Traceback" not in result.stderr and not list((tmp_path / "outputs").glob("runs/*/*/config.yaml"))


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_override_carries_the_weights_and_starts_the_optimizer_fresh(chain: Chain,
                                                                         tmp_path: Path) -> None:
    reference = chain[REFERENCE][0]
    result = train(tmp_path, "stage2", "none", 1, 2, 1, f"resume={ckpt(reference, M - 2)}", "optimizer=adam",
                   "resume_optimizer=reset")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WEIGHTS ONLY" in result.stderr
    (run_dir,) = run_dirs(tmp_path)
    assert "WEIGHTS ONLY" in (run_dir / "config.yaml").read_text()  # the warning is recorded with the run
    got, expected = metrics(run_dir), metrics(reference)
    assert sorted(got) == [M - 1, M]
    # The first step's loss is computed before any update: the same weights and samples give the same loss.
    assert got[M - 1]["loss"] == pytest.approx(expected[M - 1]["loss"], rel=1e-4)
    assert got[M - 1]["lr"] == expected[M - 1]["lr"]
    meta, _ = portable_state(ckpt(run_dir, M))
    assert (meta["step"], meta["optimizer_step"], meta["identity"]["optimizer"]) == (M, 2, "adam")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget (64 s, two runs of its own): convert --unet runs in test_single_file by default
def test_offline_export_of_a_two_rank_stage3_checkpoint_equals_zero_to_fp32(chain: Chain,
                                                                            tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    saved = ckpt(chain["stage3_x2"][0], M)
    result = convert(saved, "--unet", tmp_path / "unet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = load_file(tmp_path / "unet" / "diffusion_pytorch_model.safetensors")
    expected = get_fp32_state_dict_from_zero_checkpoint(str(saved))
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.long), 3])  # ZeRO-3's layout is the harder
def test_an_accelerate_deepspeed_checkpoint_of_another_tool_is_imported_and_continues(tmp_path: Path,
                                                                                      stage: int) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    source = tmp_path / "diffusers_script_checkpoint"
    script = Path(__file__).parent / "scripts" / "foreign_checkpoint.py"
    made = subprocess.run([sys.executable, str(script), str(source), str(stage), "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1800)
    assert made.returncode == 0, made.stderr[-3000:]
    imported = tmp_path / "imported"
    result = convert(source, "--import-to", imported, "--architecture", "sdxl_tiny", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = load_file(imported / "portable" / "state-00001.safetensors")
    for key, value in get_fp32_state_dict_from_zero_checkpoint(str(source)).items():
        torch.testing.assert_close(weights[f"fp32/{key}"], value, rtol=0, atol=0, msg=key)
    assert all(weights[k].abs().max() > 0 for k in weights if k.startswith("exp_avg_sq/") and "norm" not in k)
    _a_planted_payload_is_refused_unrun(source, tmp_path)
    resumed = train(tmp_path / "run", "stage1", "none", 1, 1, 1, f"resume={imported}", "train.max_steps=3",
                    "scheduler.warmup_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2 under another configuration" in resumed.stderr and "Adam moments" in resumed.stderr
    (run_dir,) = run_dirs(tmp_path / "run")
    assert sorted(metrics(run_dir)) == [3]


class _Payload:
    """Unpickled, it writes the file its argument names: what a planted checkpoint file would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _a_planted_payload_is_refused_unrun(source: Path, tmp_path: Path) -> None:
    """Each of a foreign checkpoint's DeepSpeed files replaced by a pickle that runs code: the import refuses it in
    one line, naming the file, and the code never runs (every torch.load is weights-only)."""
    import shutil

    for planted in ("*optim_states.pt", "*model_states.pt"):
        copy, marker = tmp_path / f"planted_{planted[1:6]}", tmp_path / f"ran_{planted[1:6]}"
        shutil.copytree(source, copy)
        target = next(copy.rglob(planted))
        torch.save({"optimizer_state_dict": _Payload(marker), "module": {}}, target)
        result = convert(copy, "--import-to", tmp_path / f"out_{planted[1:6]}", cwd=tmp_path)
        assert result.returncode == 2 and not marker.exists(), (planted, result.stderr[-2000:])
        assert target.name in result.stderr and "could run code" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_a_schedule_state_that_would_run_code_or_is_damaged_is_refused_unrun(tmp_path: Path) -> None:
    """portable/scheduler.pt is read weights-only: a planted pickle is refused naming the file and never runs, a cut or
    empty file is refused the same way, and the schedule a run saves reads back as it was."""
    from ds_trainer.errors import TrainingError
    from ds_trainer.train.state import portable

    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                                              lambda step: min(1.0, (step + 1) / 10))
    sched.step()
    torch.save(sched.state_dict(), tmp_path / "scheduler.pt")
    assert portable.scheduler_state(tmp_path / "scheduler.pt") == sched.state_dict()
    marker = tmp_path / "ran"
    torch.save({"last_epoch": _Payload(marker)}, tmp_path / "planted.pt")
    good = (tmp_path / "scheduler.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(good[: len(good) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    for name in ("planted.pt", "cut.pt", "empty.pt"):
        with pytest.raises(TrainingError, match=name) as refused:
            portable.scheduler_state(tmp_path / name)
        assert "resume from a checkpoint a ds_trainer run wrote" in str(refused.value).lower()
    assert not marker.exists()


def test_convert_reports_a_bad_folder_in_one_line(tmp_path: Path) -> None:
    result = convert(tmp_path / "missing", "--unet", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and "not a folder" in result.stderr and "Traceback" not in result.stderr
    result = convert(tmp_path, "--import-to", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and "_optim_states.pt" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.long  # CI budget: the carries with portable state run by default
def test_a_checkpoint_without_portable_state_resumes_under_its_own_layout_or_after_conversion(tmp_path: Path) -> None:
    short = ["train.max_steps=2", "scheduler.warmup_steps=2"]
    saved_run = train(tmp_path / "a", "stage2", "none", 1, 2, 1, "train.portable_state=false", *short)
    assert saved_run.returncode == 0, saved_run.stderr[-3000:]
    saved = ckpt(run_dirs(tmp_path / "a")[0], 2)
    assert not (saved / "portable").exists() and (saved / "COMPLETE").is_file()
    # Under another layout: refused before anything starts, with the way back and the conversion.
    refused = run_cli(f"resume={saved}", "zero=stage1", "dry_run=true", *COMMON, cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "train.portable_state=false" in refused.stderr and "zero: stage2 -> stage1" in refused.stderr
    assert "zero=stage2" in refused.stderr and "--import-to" in refused.stderr
    more = ["train.max_steps=3", "scheduler.warmup_steps=3"]
    # Under its own layout: DeepSpeed's native load.
    native = train(tmp_path / "b", "stage2", "none", 1, 2, 1, f"resume={saved}", "train.portable_state=false", *more)
    assert native.returncode == 0 and "under another configuration" not in native.stderr, native.stderr[-3000:]
    assert sorted(metrics(run_dirs(tmp_path / "b")[0])) == [3]
    # Converted offline, it carries to another layout.
    converted = convert(saved, "--import-to", tmp_path / "imported", "--architecture", "sdxl_tiny", cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr[-3000:]
    carried = train(tmp_path / "c", "stage1", "none", 1, 2, 1, f"resume={tmp_path / 'imported'}", *more)
    assert carried.returncode == 0, carried.stderr[-3000:]
    assert "at step 2 under another configuration" in carried.stderr and "Adam moments" in carried.stderr
    assert metrics(run_dirs(tmp_path / "c")[0])[3]["loss"] == pytest.approx(
        metrics(run_dirs(tmp_path / "b")[0])[3]["loss"], rel=1e-4)
