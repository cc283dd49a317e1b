"""Context parallelism (`parallel.context`): one sample's sequence split over two ranks (gloo's
all-to-all on the CPU) gives the one-rank run's training: for each transformer family (Flux.1,
FLUX.2, Qwen-Image and Wan through diffusers' plans, SD3 through ds_trainer's joint attention) at
tiny size, under FSDP2 and under ZeRO-3, LoRA and full, the loss and the gradient's norm at every
step and the weights at the end agree with a one-rank run of the same data to float noise (fp32:
1e-5 here; the default run pairs each family, backend and method once, make test-long runs the rest
of the product); a ZeRO-2 run at context 2 resumes into a context-1 DDP run and continues as it would
have; what cannot split is refused before the first step with its reason. Slow tests share the runs
(the module's `runs`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import numerics
from helpers.cfg import make_cfg
from helpers.ranks import train

from ds_trainer.config import checks

torch = pytest.importorskip("torch")

COMMON = ["logger=none", "train.max_steps=4", "data.num_samples=4", "resolution.width=64", "resolution.height=64",
          "scheduler=constant", "optimizer.lr=1e-3", "precision=fp32", "train.micro_batch_size=1",
          "data.video.frames=[5]"]
# (model, the context-2 run's backend and adapter); each against a one-rank DDP run of the same
# adapter. SD3's caption is CLIP's 77 tokens and T5's: 33 of T5's make 110, which two ranks split.
SD3 = "model=sd3_tiny model.flow.t5_max_length=33"
FAMILIES = {"wan": "model=wan_tiny", "flux": "model=flux_tiny", "qwen": "model=qwen_image_tiny", "sd3": SD3,
            "flux2": "model=flux2_tiny"}
BACKENDS = {"z3": "stage3", "fsdp": "fsdp_full_shard"}
# Every family under both backends, LoRA and full; the default run's cells pair each family, backend
# and method once, the rest run in make test-long.
EVERY = {f"{family}_{backend}{'_lora' * (method == 'lora')}": (model, zero, method)
         for family, model in FAMILIES.items() for backend, zero in BACKENDS.items()
         for method in ("none", "lora")}
CELLS = {name: EVERY[name] for name in ("wan_z3", "wan_fsdp_lora", "flux_fsdp", "qwen_z3_lora", "sd3_fsdp",
                                        "flux2_z3_lora")}
LONG = {name: cell for name, cell in EVERY.items() if name not in CELLS}


def _train(cwd: Path, ranks: int, *overrides: str) -> Path:
    return train(cwd, ranks, *COMMON, *overrides)


@pytest.fixture(scope="module")
def runs(module_tmp: Callable[[str], Path]) -> Callable[[str], Path]:
    root, done = module_tmp("context"), {}

    def get(name: str) -> Path:
        if name not in done:
            if name.startswith("one_"):  # a one-rank reference: the model and adapter of a cell, DDP
                model, _, method = EVERY[name.removeprefix("one_")]
                family = next(f for f, m in FAMILIES.items() if m == model)
                shared = f"one_{family}_{method}"  # one reference a model and adapter, whichever backend
                if shared not in done:
                    done[shared] = _train(root / shared, 1, *model.split(), "zero=ddp", f"adapter={method}")
                done[name] = done[shared]
            elif name == "split_z2":  # context 2 under ZeRO-2, a checkpoint at step 2
                done[name] = _train(root / name, 2, "model=wan_tiny", "zero=stage2", "parallel.context=2",
                                    "train.checkpoint_every=2")
            elif name == "resumed_ddp":  # the same steps 3 and 4 at context 1, DDP on one rank, micro batch 1
                start = get("split_z2") / "checkpoints" / "step_00000002"
                done[name] = _train(root / name, 1, "model=wan_tiny", "zero=ddp", f"resume={start}")
            else:
                model, zero, method = EVERY[name]
                done[name] = _train(root / name, 2, *model.split(), f"zero={zero}", f"adapter={method}",
                                    "parallel.context=2")
        return done[name]
    return get


def _metrics(run_dir: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row[key] for row in rows if key in row}


def _trained(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    lora = run_dir / "lora" / "pytorch_lora_weights.safetensors"
    return load_file(lora if lora.exists() else run_dir / "transformer" / "diffusion_pytorch_model.safetensors")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("cell", [*sorted(CELLS), *(pytest.param(c, marks=pytest.mark.long) for c in sorted(LONG))])
def test_a_sequence_split_over_two_ranks_trains_as_one_rank_does(runs: Callable[[str], Path], cell: str) -> None:
    split, one = runs(cell), runs(f"one_{cell}")
    log = (split / "ds_trainer.log").read_text()
    assert "parallel.context=2: each sample's sequence is split over 2 ranks (ulysses attention), 1 data" in log
    summary = json.loads((split / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    for key in ("loss", "grad_norm"):
        got, expected = _metrics(split, key), _metrics(one, key)
        assert sorted(got) == [1, 2, 3, 4]
        for step in got:  # a gradient of half the norm (a context group's parts averaged, not summed) fails
            assert got[step] == pytest.approx(expected[step], rel=1e-5), (key, step)
    got, expected = _trained(split), _trained(one)
    start = numerics.mean_abs_difference(expected, {k: v * 0 for k, v in expected.items()})
    assert numerics.mean_abs_difference(got, expected) < 1e-5 * start


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_context_two_checkpoint_resumes_into_a_context_one_run(runs: Callable[[str], Path]) -> None:
    """The portable state knows no context size: the data continues where the context-2 run's was
    (its one stream), the steps 3 and 4 as it trained them."""
    split, resumed = runs("split_z2"), runs("resumed_ddp")
    got, expected = _metrics(resumed, "loss"), _metrics(split, "loss")
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.parametrize(("overrides", "says", "fix"), [
    (["model=sdxl_tiny"], "UNet has no sequence to split: its convolutions", "parallel.context=1"),
    (["model=chroma_tiny"], "(ChromaTransformer2DModel) has no context-parallel plan", "parallel.context=1"),
    (["model=z_image_tiny"], "(ZImageTransformer2DModel) has no context-parallel plan", "parallel.context=1"),
    (["model=wan_tiny", "world_size=3", "parallel.context=3"], "share of model=wan_tiny's 2 attention heads",
     "parallel.context=2"),
    (["model=flux_tiny", "world_size=3", "parallel.context=2"], "splits the 3 ranks into groups of 2",
     "parallel.context=3"),
    (["model=flux_tiny", "parallel.attention=ring"], "log-sum-exp", "parallel.attention=ulysses"),
    (["model=flux_tiny", "train.attention=math"], "attention dispatch", "train.attention=sdpa"),
    (["model=flux_kontext_tiny"], "not built for an editing model", "parallel.context=1"),
    (["model=sd3_tiny"], "caption tokens (CLIP's 77 + model.flow.t5_max_length) into 2 equal parts", "parallel"),
])
def test_what_cannot_split_is_refused_with_the_fix(overrides: list[str], says: str, fix: str) -> None:
    report = checks.check(make_cfg("parallel.context=2", "world_size=2", *overrides))
    text = report.render()
    assert not report.ok and says in text and f"fix: {fix}" in text, text


def test_a_split_sequence_that_two_does_not_divide_is_refused_naming_the_size() -> None:
    """Flux at 80 x 48 px: 5 x 3 = 15 image tokens; Wan at 48 x 48 px: 3 x 3 = 9 tokens a latent
    frame, an image (one frame) 9."""
    report = checks.check(make_cfg("model=flux_tiny", "parallel.context=2", "world_size=2",
                                   "resolution.width=80", "resolution.height=48"))
    assert "at 80x48 there are 15, which 2 does not divide" in report.render()
    report = checks.check(make_cfg("model=wan_tiny", "parallel.context=2", "world_size=2", "resolution.width=48",
                                   "resolution.height=48", "data.video.frames=[1,5]"))
    assert "at 48x48, 1 frame(s) there are 9, which 2 does not divide" in report.render()


def test_the_planner_splits_a_long_clips_activations_and_counts_the_all_to_all() -> None:
    """Wan 2.1 14B at 720p, 81 frames, ZeRO-3 on 8 GPUs: the activations per rank halve at context 2
    and quarter at 4, the all-to-all's buffers are added, and the README says the peaks."""
    from ds_trainer.tools import plan

    peaks, activations, buffers = [], [], []
    for context in (1, 2, 4):
        cfg = checks.check(make_cfg("model=wan21_t2v_14b", "resolution.width=1280", "resolution.height=720",
                                    "data.video.frames=[81]", "train.gradient_checkpointing=true", "world_size=8",
                                    f"parallel.context={context}", "zero=stage3")).cfg
        e = plan.estimate(cfg, "stage3", "none", 8)
        peaks.append(e.gpu / 2**30)
        activations.append(e.activations)
        buffers.append(e.buffers)
    assert activations[1] == activations[0] // 2 and activations[2] == activations[0] // 4
    assert buffers[0] < buffers[2] < buffers[1]  # the all-to-all's: each rank's part of the tokens
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "93.4 GiB per GPU above" in readme and f"{peaks[0]:.1f}" == "93.4"
    assert f"brings it to {peaks[1]:.1f} GiB, over four to {peaks[2]:.1f}." in readme.replace("\n", " ")
