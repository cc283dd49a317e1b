"""Training SDXL's text encoders with the UNet (`text_encoders=lora|full`) on the CPU: one module in one engine, a
parameter group per component, the embeddings of a trained encoder computed every step, the combined LoRA file that
one `load_lora_weights` call loads, the full export, samples with the trained encoders under ZeRO-3 and FSDP,
checkpoints that resume natively and under another layout, and the one-screen errors.

Three shared two-rank runs carry most checks: LoRA UNet + LoRA encoders under ZeRO-2 (at their own learning rate),
and full UNet + full encoders in fp32 with EMA and a sample under ZeRO-3 and under FSDP2. `make test-long` trains both
kinds under DDP, ZeRO-2, ZeRO-3 and FSDP on two ranks to a falling loss.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import numerics
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.ranks import torchrun

torch = pytest.importorskip("torch")
# One worker runs this module's tests, so its two shared runs are trained once (not once per pytest-xdist worker).
pytestmark = pytest.mark.xdist_group("text_encoders")

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # exact pixel comparisons (tests/test_sampling.py says why)
LORA_LR, TEXT_LR = 1e-4, 3e-4
LORA_RUN = ["zero=stage2", "adapter=lora", "adapter.rank=4", "adapter.alpha=4", "text_encoders=lora",
            f"optimizer.lr={LORA_LR}", f"text_encoders.lr={TEXT_LR}", "scheduler=warmup", "scheduler.warmup_steps=2",
            "scheduler.warmup_type=linear", "text_encoders.warmup_steps=4", "train.max_steps=4",
            "train.checkpoint_every=2", "data.num_samples=4", "logger=none"]
FULL_RUN = ["zero=stage3", "text_encoders=full", "precision=fp32", f"optimizer.lr={LORA_LR}",
            f"text_encoders.lr={TEXT_LR}", "train.max_steps=4", "train.checkpoint_every=2", "data.num_samples=4",
            "logger=none", "train.ema=true", "train.ema_decay=0.5", "samples=on", "samples.every=0",
            "samples.steps=2", "samples.seeds=[5]", "samples.prompts=[a red square]"]
PROMPT = "a red square on a blue background"


def _two_ranks(cwd: Path, *overrides: str) -> Path:
    cwd.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([*torchrun(2), "-m", "ds_trainer", *overrides], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, **ONE_THREAD}, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir


@pytest.fixture(scope="module")
def lora_run(module_tmp: Callable[[str], Path]) -> Path:
    return _two_ranks(module_tmp("te_lora"), *LORA_RUN)


@pytest.fixture(scope="module")
def full_run(module_tmp: Callable[[str], Path]) -> Path:
    return _two_ranks(module_tmp("te_full"), *FULL_RUN)


@pytest.fixture(scope="module")
def fsdp_run(module_tmp: Callable[[str], Path]) -> Path:
    """The full run under FSDP2: the encoders' layers units of their own, the rest of them in the root unit."""
    return _two_ranks(module_tmp("te_fsdp"), *FULL_RUN, "zero=fsdp_full_shard")


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(path))


def _model_weights(folder: Path) -> dict[str, Any]:
    (file,) = [f for f in folder.glob("*.safetensors")]
    return _safetensors(file)


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_unet_and_encoders_train_into_one_file(lora_run: Path) -> None:
    tensors = _safetensors(lora_run / "lora" / "pytorch_lora_weights.safetensors")
    assert {k.split(".")[0] for k in tensors} == {"unet", "text_encoder", "text_encoder_2"}
    # peft starts every up (B) matrix at zero: each one moved, so every adapter of every component trained.
    ups = {k: v for k, v in tensors.items() if ".up." in k or "lora_B" in k}
    assert ups and all(v.abs().max() > 0 for v in ups.values()), [k for k, v in ups.items() if v.abs().max() == 0]
    # CLIP-L's last layer feeds nothing SDXL reads: no adapter there (sdxl_tiny's CLIP-L has layers 0 and 1).
    clip_l = [k for k in tensors if k.startswith("text_encoder.")]
    assert clip_l and not any(".layers.1." in k for k in clip_l)
    assert any(".layers.1." in k for k in tensors if k.startswith("text_encoder_2."))  # bigG's last layer trains
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert set(summary["trained_parameters"]) == {"unet", "text_encoder", "text_encoder_2"}
    assert all(n > 0 for n in summary["trained_parameters"].values())


@pytest.mark.slow
@pytest.mark.multiproc
def test_each_component_warms_up_to_its_own_learning_rate_over_its_own_steps(lora_run: Path) -> None:
    rows = _rows(lora_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # DeepSpeed's linear WarmupLR: peak x min(1, iteration / warm-up), the iteration after step k being k - 1. The
    # UNet's group warms up over 2 steps to optimizer.lr, the encoders' over 4 to text_encoders.lr.
    for row in rows:
        k = row["step"] - 1
        assert math.isclose(row["lr"], LORA_LR * min(1.0, k / 2), rel_tol=1e-9, abs_tol=1e-15), row
        assert math.isclose(row["lr_text_encoders"], TEXT_LR * min(1.0, k / 4), rel_tol=1e-9, abs_tol=1e-15), row
    # What DeepSpeed's optimizer itself held when step 2's checkpoint was written: those same two LRs.
    (optim,) = (lora_run / "checkpoints" / "step_00000002").glob("pytorch_model/*zero_pp_rank_0_*optim_states.pt")
    groups = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"][
        "base_optimizer_state"]["param_groups"]
    assert [g["lr"] for g in groups] == [rows[1]["lr"], rows[1]["lr_text_encoders"]]
    assert "per parameter group" in (lora_run / "ds_trainer.log").read_text()


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_lora_file_loads_in_one_call_and_unloads(lora_run: Path) -> None:
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(lora_run / "pipeline")  # the untrained base
    pipe.set_progress_bar_config(disable=True)

    def embeds_and_image() -> tuple[Any, Any]:
        embeds = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False)
        image = pipe(PROMPT, num_inference_steps=2, width=128, height=128, output_type="np",
                     generator=torch.Generator().manual_seed(1)).images[0]
        return embeds, image

    (base_embeds, _, base_pooled, _), base_image = embeds_and_image()
    pipe.load_lora_weights(lora_run / "lora")
    (embeds, _, pooled, _), image = embeds_and_image()
    assert not torch.equal(embeds, base_embeds) and not torch.equal(pooled, base_pooled)
    assert (image != base_image).any()
    pipe.unload_lora_weights()
    (again, _, again_pooled, _), unloaded = embeds_and_image()
    assert torch.equal(again, base_embeds) and torch.equal(again_pooled, base_pooled)
    assert (unloaded == base_image).all()
    # kohya's layout: the encoders' adapters as lora_te1_*/lora_te2_* in transformers' names, the UNet's in SGM's;
    # diffusers' kohya converter loads all three to the same embeddings and image.
    kohya = _safetensors(lora_run / "lora" / "kohya.safetensors")
    assert {k.split("_")[1] for k in kohya} == {"unet", "te1", "te2"}
    assert "lora_te2_text_model_encoder_layers_1_self_attn_q_proj.lora_down.weight" in kohya
    pipe.load_lora_weights(lora_run / "lora" / "kohya.safetensors")
    (k_embeds, _, k_pooled, _), k_image = embeds_and_image()
    torch.testing.assert_close(k_embeds, embeds, rtol=0, atol=1e-5)
    torch.testing.assert_close(k_pooled, pooled, rtol=0, atol=1e-5)
    assert abs(k_image - image).max() < 1e-4


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_lora_run_with_encoders_resumes_natively_bit_for_bit(lora_run: Path, tmp_path: Path) -> None:
    resumed = _two_ranks(tmp_path, *LORA_RUN, f"resume={lora_run / 'checkpoints' / 'step_00000002'}",
                         "train.final_checkpoint=false")
    assert [r["step"] for r in _rows(resumed)] == [3, 4]
    assert [r["loss"] for r in _rows(resumed)] == [r["loss"] for r in _rows(lora_run)][2:]
    got = _safetensors(resumed / "lora" / "pytorch_lora_weights.safetensors")
    expected = _safetensors(lora_run / "lora" / "pytorch_lora_weights.safetensors")
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.slow
@pytest.mark.multiproc
# CI budget (60 s, a two-rank run of its own): FSDP2's variant in `make test-long`; FSDP2's exports and samples run
# by default in test_fsdp.
@pytest.mark.parametrize("run", ["full_run", pytest.param("fsdp_run", marks=pytest.mark.long)], ids=["zero3", "fsdp"])
def test_full_encoders_are_exported_trained_and_sampled(run: str, request: pytest.FixtureRequest) -> None:
    from diffusers import StableDiffusionXLPipeline

    from ds_trainer.train.families import sdxl

    full_run = request.getfixturevalue(run)
    for row in _rows(full_run):  # the encoders' group follows the UNet's warm-up at its own peak
        assert math.isclose(row["lr_text_encoders"], row["lr"] * TEXT_LR / LORA_LR, rel_tol=1e-9), row
    if run == "full_run":  # DeepSpeed's JSON schedule, a peak per parameter group
        ds = json.loads((full_run / "ds_config.json").read_text())
        assert ds["scheduler"]["params"]["warmup_max_lr"] == [LORA_LR, TEXT_LR]

    base = sdxl.load_frozen(make_cfg())  # the untrained encoders (sdxl_tiny's seeded random weights)
    counted = json.loads((full_run / "summary.json").read_text())["trained_parameters"]  # whole, though sharded
    assert counted["unet"] == sum(v.numel() for v in _model_weights(full_run / "unet").values())
    for name in ("text_encoder", "text_encoder_2"):
        trained = _model_weights(full_run / name)
        untouched = {k: v for k, v in getattr(base, name).state_dict().items() if k in trained}
        moved = [k for k in trained if not torch.equal(trained[k], untouched[k])]
        frozen = [k for k in trained if ".layers.1." in k or "final_layer_norm" in k] if name == "text_encoder" else []
        assert frozen and all(k not in moved for k in frozen) or name == "text_encoder_2"
        assert set(moved) == set(trained) - set(frozen), sorted(set(trained) - set(frozen) - set(moved))[:5]
        assert counted[name] == sum(trained[k].numel() for k in moved)
        assert (full_run / f"{name}_ema").is_dir()
    # The sample used the trained encoders and the EMA (samples.ema): the exported pipeline holds those, in fp32,
    # and makes the same image.
    pipe = StableDiffusionXLPipeline.from_pretrained(full_run / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    for name in ("unet", "text_encoder", "text_encoder_2"):
        exported = _model_weights(full_run / "pipeline" / name)
        assert all(torch.equal(exported[k], v) for k, v in _model_weights(full_run / f"{name}_ema").items())
    import numpy as np
    from PIL import Image

    got = np.asarray(Image.open(full_run / "samples" / "step_00000004" / "0_5.png").convert("RGB"))
    assert (got == _pipeline_image(full_run / "pipeline", "a red square", 5)).all()


def _pipeline_image(pipeline: Path, prompt: str, seed: int) -> Any:
    import numpy as np

    out = pipeline.parent / f"reference_{seed}.npy"
    script = Path(__file__).parent / "scripts" / "sample_reference.py"
    cmd = [sys.executable, str(script), str(pipeline), prompt, str(seed),
           str(out)]
    result = subprocess.run(cmd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


@pytest.mark.slow
@pytest.mark.multiproc
# CI budget: the default variant resumes the ZeRO-3 run the export test trains anyway; FSDP2's (a two-rank run of
# its own, 60 s, and this resume, 73 s) is in `make test-long`.
@pytest.mark.parametrize(("run", "zero"), [("full_run", "ddp"),
                                           pytest.param("fsdp_run", "stage2", marks=pytest.mark.long)],
                         ids=["zero3_to_ddp", "fsdp_to_stage2"])
def test_full_encoders_resume_from_two_ranks_under_another_backend_on_one(run: str, zero: str, tmp_path: Path,
                                                                         request: pytest.FixtureRequest) -> None:
    full_run = request.getfixturevalue(run)
    result = run_cli(*FULL_RUN, f"zero={zero}", "train.micro_batch_size=2", "samples=none",
                     f"resume={full_run / 'checkpoints' / 'step_00000002'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (resumed,) = run_dirs(tmp_path)
    log = (resumed / "ds_trainer.log").read_text()
    # The portable state carried every trained parameter of the three components, not a native load.
    carried = re.search(r"under another configuration .* carried fp32 weights and Adam moments .* of (\d+)/(\d+) "
                        "trainable", log)
    assert carried and carried[1] == carried[2], log[-2000:]
    assert [r["step"] for r in _rows(resumed)] == [3, 4]
    for name in ("unet", "text_encoder", "text_encoder_2"):
        numerics.assert_same_weights(_model_weights(resumed / name), _model_weights(full_run / name),
                                     f"{name} resumed under {zero}")


OVERFIT = ["logger=none", "data.num_samples=2", "train.micro_batch_size=2", "train.max_steps=40", "scheduler=constant",
           "optimizer.lr=1e-3", "train.final_checkpoint=false", "train.export=false"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long
@pytest.mark.parametrize("zero", ["ddp", "stage2", "stage3", "fsdp_full_shard"])
@pytest.mark.parametrize("kind", [("adapter=lora", "text_encoders=lora", "adapter.targets=[to_q,to_k,to_v,to_out.0,"
                                   "ff.net.0.proj,ff.net.2,proj_in,proj_out,conv1,conv2]", "optimizer.lr=1e-2"),
                                  ("text_encoders=full",)], ids=["lora", "full"])
def test_every_stage_trains_unet_and_encoders_to_a_falling_loss(tmp_path: Path, zero: str,
                                                                 kind: tuple[str, ...]) -> None:
    run_dir = _two_ranks(tmp_path, *OVERFIT, "train.micro_batch_size=1", f"zero={zero}", *kind)
    losses = [r["loss"] for r in _rows(run_dir)]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.6 * first, (first, last)


@pytest.mark.slow
@pytest.mark.multiproc
def test_reset_carries_the_unet_adapters_into_a_run_with_frozen_encoders(lora_run: Path, tmp_path: Path) -> None:
    # resume_optimizer=reset: the weights whose names match carry (the UNet's, saved as `unet.…` in the trained
    # module, are the UNet's own here), the encoders' adapters are left behind. At an LR too small to move anything
    # the export is the UNet's part of the file the run it came from wrote.
    result = run_cli(*LORA_RUN, "zero=ddp", "text_encoders=frozen", "resume_optimizer=reset", "train.max_steps=5",
                     "optimizer.lr=1e-30", "scheduler=constant", "scheduler.warmup_steps=0",
                     f"resume={lora_run / 'checkpoints' / 'step_00000004'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert [r["step"] for r in _rows(run_dir)] == [5]
    assert "WEIGHTS ONLY" in (run_dir / "ds_trainer.log").read_text()
    got = _safetensors(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    before = {k: v for k, v in _safetensors(lora_run / "lora" / "pytorch_lora_weights.safetensors").items()
              if k.startswith("unet.")}
    assert got.keys() == before.keys()
    assert max(float((got[k].float() - before[k].float()).abs().max()) for k in got) < 1e-20


def _refused(workdir: Path, *overrides: str) -> str:
    result = run_cli("logger=none", "train.max_steps=1", *overrides, cwd=workdir)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result.stderr


def test_bad_text_encoder_settings_get_the_one_screen_message(workdir: Path) -> None:
    out = _refused(workdir, "text_encoders=lora", "text_encoders.targets=[q_proj,attn_out]")
    assert "text_encoders.targets" in out and "attn_out" in out and "fc1" in out  # the names that exist
    out = _refused(workdir, "text_encoders=lora", "text_encoders.which=clip_g")
    assert "text_encoders.which" in out and "bigg" in out
    out = _refused(workdir, "text_encoders=lora", "text_encoders.rank=0", "text_encoders.lr=-1")
    assert "text_encoders.rank=0" in out and "text_encoders.lr=-1" in out
    out = _refused(workdir, "text_encoders=lora", "scheduler=constant", "text_encoders.warmup_steps=10")
    assert "text_encoders.warmup_steps=10" in out and "scheduler=warmup" in out


@pytest.mark.slow
@pytest.mark.multiproc
def test_resuming_with_another_text_encoder_choice_is_refused(lora_run: Path, workdir: Path) -> None:
    checkpoint = lora_run / "checkpoints" / "step_00000002"
    out = _refused(workdir, *LORA_RUN, "text_encoders=frozen", f"resume={checkpoint}")
    assert "text_encoders" in out and "resume_optimizer=reset" in out


def test_a_trained_encoder_caches_token_ids_not_embeddings(tmp_path: Path) -> None:
    from ds_trainer.train import data, families

    def cache_of(*overrides: str) -> data.LatentCache:
        cfg = make_cfg(f"data.cache_dir={tmp_path}", *overrides)
        return data.LatentCache(cfg, data.dataset(cfg), families.of(cfg), "cpu")

    frozen, both, bigg = cache_of(), cache_of("text_encoders=lora"), cache_of("text_encoders=full",
                                                                              "text_encoders.which=bigg")
    assert len({frozen.dir, both.dir, bigg.dir}) == 3  # the key knows what trains
    from ds_trainer.train.families import sdxl, text_encoders

    cfg = make_cfg("text_encoders=full", "text_encoders.which=bigg")
    parts = sdxl.load_frozen(cfg)
    text_encoders.take(cfg, parts)
    inputs = sdxl.text_inputs(parts, ["a cat"], torch.device("cpu"))
    assert set(inputs) == {"input_ids_2", "embeds_1"}  # bigG's ids, CLIP-L's cached embeddings
    assert inputs["input_ids_2"].dtype == torch.int64


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # init_from's own tests (test_lora.py) run by default; this is its two-rank, encoders' variant
def test_a_lora_file_with_encoder_adapters_continues_and_one_without_is_refused(lora_run: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    trained = lora_run / "lora" / "pytorch_lora_weights.safetensors"
    # Continued at a learning rate too small to move anything: the export is the file it started from, UNet and
    # encoders alike (each adapter loaded from it, into ZeRO-3's fp32 masters too). Under ZeRO-3 on two ranks the
    # end of the run also builds the base pipeline on rank 0 (its encoders loaded again), outside ZeRO-3's hooks.
    run_dir = _two_ranks(tmp_path / "continued", *LORA_RUN, "zero=stage3", "train.max_steps=1",
                         "optimizer.lr=1e-30", "text_encoders.lr=1e-30", "scheduler=constant",
                         "scheduler.warmup_steps=0", "text_encoders.warmup_steps=null", f"adapter.init_from={trained}")
    assert (run_dir / "pipeline" / "text_encoder").is_dir()
    got, started = _safetensors(run_dir / "lora" / "pytorch_lora_weights.safetensors"), _safetensors(trained)
    assert got.keys() == started.keys() and {k.split(".")[0] for k in got} == {"unet", "text_encoder",
                                                                              "text_encoder_2"}
    assert max(float((got[k] - started[k]).abs().max()) for k in got) < 1e-20
    unet_only = tmp_path / "unet_only.safetensors"
    save_file({k: v for k, v in started.items() if k.startswith("unet.")}, unet_only)
    out = _refused(tmp_path, *LORA_RUN, f"adapter.init_from={unet_only}")
    assert "adapter.init_from" in out and "no LoRA tensors for text_encoder" in out and "text_encoders=frozen" in out
