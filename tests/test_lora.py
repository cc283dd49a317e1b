"""adapter=lora end to end on the CPU: every ZeRO stage and offload, two ranks, the diffusers LoRA file,
checkpoints of the trainable state only, resume after a kill, and the one-screen errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.deps import require
from helpers.procs import wait_until
from helpers.ranks import free_port, one_rank_process_group, torchrun

from ds_trainer.config import checks, nvme

torch = pytest.importorskip("torch")

LORA = ["adapter=lora", "logger=none", "data.num_samples=4"]
# The shared run: a small rank keeps the checkpoint small next to the tiny UNet (rank 16 on SDXL's
# 2.6B parameters is 0.9% of them; on sdxl_tiny 5%).
SHARED = [*LORA, "zero=stage2", "adapter.rank=4", "adapter.alpha=4", "train.max_steps=6", "train.checkpoint_every=3",
          "train.ema=true"]
# The default suite trains the cells whose code differs most (DDP, ZeRO-2's offload, ZeRO-3's partitioned adapters on
# the host and swapped to NVMe); `make test-long` the rest.
CELLS = [("ddp", "none"), pytest.param("stage0", "none", marks=pytest.mark.long),
         pytest.param("stage1", "none", marks=pytest.mark.long), pytest.param("stage1", "cpu", marks=pytest.mark.long),
         ("stage2", "cpu"), pytest.param("stage3", "none", marks=pytest.mark.long), ("stage3", "cpu"),
         ("stage3", "nvme")]


def summary(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "summary.json").read_text()))


def lora_tensors(folder: Path, name: str = "pytorch_lora_weights.safetensors") -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(folder / name))


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def assert_full_lora_file(run_dir: Path) -> dict[str, Any]:
    tensors = lora_tensors(run_dir / "lora")
    assert tensors and all(k.startswith("unet.") and ".lora." in k for k in tensors)
    assert all(t.ndim == 2 and t.numel() > 0 for t in tensors.values()), "empty (ZeRO-3 placeholder) tensors"
    return tensors


@pytest.fixture(scope="module")
def shared_run(module_tmp: Callable[[str], Path]) -> Path:
    cwd = module_tmp("lora_shared")
    result = run_cli(*SHARED, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "offload"), CELLS)
def test_lora_trains_in_every_zero_and_offload_cell(workdir: Path, zero: str, offload: str) -> None:
    if offload == "nvme":
        require(nvme.aio_prerequisites() is None, "libaio-dev is not installed")
    result = run_cli(*LORA, f"zero={zero}", f"offload={offload}", "train.max_steps=2", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    s = summary(run_dir)
    assert s["status"] == "ok" and s["steps"] == 2 and s["method"] == "lora"
    assert 0 < s["trainable_params"] < 0.1 * make_cfg().model.param_count
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists()
    assert_full_lora_file(run_dir)
    assert not (run_dir / "unet").exists()


@pytest.mark.slow
def test_lora_file_loads_into_the_pipeline_and_unloads(shared_run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from diffusers import StableDiffusionXLPipeline

    assert_full_lora_file(shared_run)
    meta = json.loads(_metadata(shared_run / "lora")["lora_adapter_metadata"])
    assert meta["unet.r"] == 4 and meta["unet.lora_alpha"] == 4
    assert set(meta["unet.target_modules"]) == {"to_q", "to_k", "to_v", "to_out.0"}
    pipe = StableDiffusionXLPipeline.from_pretrained(shared_run / "pipeline")

    def image() -> Any:
        return pipe("a red square", num_inference_steps=2, height=128, width=128, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    base = image()
    pipe.load_lora_weights(shared_run / "lora")
    adapted = image()
    pipe.unload_lora_weights()
    assert abs(adapted - base).max() > 1e-4, "the LoRA changed nothing"
    assert (image() == base).all(), "unloading did not restore the base output"
    assert (shared_run / "lora_ema" / "pytorch_lora_weights.safetensors").exists()
    # kohya's layout (adapter.formats' default), through diffusers' own kohya converter: the same image.
    pipe.load_lora_weights(shared_run / "lora" / "kohya.safetensors")
    np.testing.assert_allclose(image(), adapted, rtol=0, atol=1e-5)
    pipe.unload_lora_weights()
    header = _metadata(shared_run / "lora", "kohya.safetensors")
    assert header["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert header["ss_network_dim"] == "4" and header["ss_base_model_version"] == "sdxl_base_v1-0"
    assert header["ss_steps"] == "6" and (shared_run / "lora_ema" / "kohya.safetensors").exists()
    # The last checkpoint's UNet, written with the adapters merged into the base: the same image, no LoRA loaded.
    from diffusers import UNet2DConditionModel

    from ds_trainer.tools import convert

    checkpoint = shared_run / "checkpoints" / "step_00000006"
    assert convert.main([str(checkpoint), "--unet", str(tmp_path / "merged")]) == 0
    assert "adapter=lora merged into the base" in capsys.readouterr().err
    base_unet, pipe.unet = pipe.unet, UNet2DConditionModel.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in pipe.unet.state_dict())
    np.testing.assert_allclose(image(), adapted, rtol=0, atol=1e-4)
    pipe.unet = base_unet
    # An earlier run's diffusers file to kohya's layout: `python -m ds_trainer.convert <run> --to kohya`.
    (tmp_path / "lora").mkdir()
    for name in ("config.yaml", "lora/pytorch_lora_weights.safetensors"):
        (tmp_path / name).write_bytes((shared_run / name).read_bytes())
    (tmp_path / "summary.json").write_bytes((shared_run / "summary.json").read_bytes())
    (tmp_path / "metrics.jsonl").write_bytes((shared_run / "metrics.jsonl").read_bytes())
    # The documented line, as written: what applies to a LoRA run is written, the single file said skipped.
    assert convert.main([str(tmp_path), "--to", "single_file,kohya,card"]) == 0
    said = capsys.readouterr().out
    assert "skipped single_file: adapter=lora trained a LoRA" in said and (tmp_path / "README.md").is_file(), said
    written = lora_tensors(tmp_path / "lora", "kohya.safetensors")
    expected = lora_tensors(shared_run / "lora", "kohya.safetensors")
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def _metadata(folder: Path, name: str = "pytorch_lora_weights.safetensors") -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(folder / name, "pt") as f:
        return dict(f.metadata())


@pytest.mark.slow
def test_checkpoint_is_20x_smaller_than_a_full_fine_tune(shared_run: Path, workdir: Path) -> None:
    full = run_cli("logger=none", "data.num_samples=4", "zero=stage2", "train.max_steps=1", "train.export=false",
                   cwd=workdir)
    assert full.returncode == 0, full.stderr[-3000:]
    (full_run,) = run_dirs(workdir)
    full_bytes = folder_bytes(full_run / "checkpoints" / "step_00000001")
    lora_bytes = folder_bytes(shared_run / "checkpoints" / "step_00000006")
    assert lora_bytes * 20 <= full_bytes, (lora_bytes, full_bytes)
    assert summary(full_run)["method"] == "none"


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_same_adapters(shared_run: Path, workdir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ds_trainer", *SHARED], cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import time

    marker = wait_until(lambda: next(iter((workdir / "outputs" / "runs").glob("*/*/checkpoints/step_00000003/"
                                                                                "COMPLETE")), None),
                        "no step-3 checkpoint appeared", deadline=time.time() + 600, proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists()
    resumed = run_cli(*SHARED, "resume=latest", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    second = run_dirs(workdir)[-1]
    for folder in ("lora", "lora_ema"):
        expected, got = lora_tensors(shared_run / folder), lora_tensors(second / folder)
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{folder}/{key}"


@pytest.mark.slow
def test_init_from_a_mismatched_file_gets_one_screen(shared_run: Path, workdir: Path) -> None:
    result = run_cli(*LORA, "adapter.rank=8", f"adapter.init_from={shared_run / 'lora'}", cwd=workdir)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "adapter.init_from=" in result.stderr and "rank 4" in result.stderr
    assert "adapter.rank=4 (the file's rank)" in result.stderr  # the fix is read from the file
    assert "Traceback" not in result.stderr
    kohya = run_cli(*LORA, "adapter.rank=8", f"adapter.init_from={shared_run / 'lora' / 'kohya.safetensors'}",
                    cwd=workdir)
    assert kohya.returncode == 2 and "Traceback" not in kohya.stderr, kohya.stderr[-3000:]
    assert "kohya-layout" in kohya.stderr and "rank 4, this adapter's is 8" in kohya.stderr, kohya.stderr[-3000:]
    assert "adapter.rank=4 (the file's rank)" in kohya.stderr
    # Trained on other modules: the fix lists the ones the file adapts.
    targets = run_cli(*LORA, "adapter.rank=4", "adapter.targets=[to_q,to_k]",
                      f"adapter.init_from={shared_run / 'lora'}", cwd=workdir)
    assert targets.returncode == 2 and "Traceback" not in targets.stderr, targets.stderr[-3000:]
    assert "adapter.targets=[to_k,to_out.0,to_q,to_v] (the modules the file adapts)" in targets.stderr
    # Another model's LoRA (a transformer's, given to the UNet): said so, with what the file holds.
    from safetensors.torch import save_file

    theirs = workdir / "flux_lora.safetensors"
    save_file({k.replace("unet.", "transformer.", 1): v for k, v in lora_tensors(shared_run / "lora").items()},
              str(theirs))
    other = run_cli(*LORA, "adapter.rank=4", f"adapter.init_from={theirs}", cwd=workdir)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "holds no UNet LoRA tensors" in other.stderr and "LoRA tensors for: transformer" in other.stderr
    assert "a LoRA file of this model's family" in other.stderr


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param("pytorch_lora_weights.safetensors", marks=pytest.mark.long),
                                    "kohya.safetensors"])
def test_init_from_continues_from_the_file(shared_run: Path, workdir: Path, layout: str) -> None:
    # One step at a negligible learning rate: the exported adapters are the file's values (from either layout).
    result = run_cli(*LORA, "zero=stage3", "adapter.rank=4", "adapter.alpha=4", "train.max_steps=1",
                     "optimizer.lr=1e-12", "scheduler=constant", f"adapter.init_from={shared_run / 'lora' / layout}",
                     cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "adapter=lora initialised from" in result.stderr
    start, got = lora_tensors(shared_run / "lora"), lora_tensors(run_dirs(workdir)[0] / "lora")
    assert start.keys() == got.keys()
    for key in start:
        torch.testing.assert_close(got[key], start[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.multiproc
# CI budget (62 s): ZeRO-3's variant in `make test-long`; test_lycoris' LoKr exports from two ZeRO-3 ranks' fp32
# masters by default.
@pytest.mark.parametrize("zero", ["stage2", pytest.param("stage3", marks=pytest.mark.long)])
def test_two_ranks_export_deepspeeds_fp32_masters(workdir: Path, zero: str) -> None:
    # A persistence threshold below every adapter matrix: under ZeRO-3 all of them are partitioned.
    cmd = [*torchrun(2), "-m", "ds_trainer", *LORA,
           f"zero={zero}", "train.max_steps=3", "zero.stage3_param_persistence_threshold=64"]
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    assert summary(run_dir)["world_size"] == 2
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    from ds_trainer.train.adapters import adapter
    from ds_trainer.train.families import sdxl

    cfg = make_cfg(*LORA)
    unet = sdxl.load_unet(cfg)
    adapter.build(cfg, unet)
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints" / "step_00000003"),
                                                    exclude_frozen_parameters=True)
    expected = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet, state_dict=fp32))
    exported = assert_full_lora_file(run_dir)
    assert exported.keys() == {f"unet.{k}" for k in expected}
    for key, value in expected.items():
        assert torch.equal(exported[f"unet.{key}"], value.float()), key


@pytest.mark.slow
def test_loss_falls_when_overfitting_one_batch(workdir: Path) -> None:
    # On sdxl_tiny's random base the attention alone cannot fit a batch; LoRA on the convolutions too
    # (Conv2d adapters, exported with the rest) can.
    targets = "[to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out,conv1,conv2,conv_in,conv_out]"
    result = run_cli("adapter=lora", f"adapter.targets={targets}", "logger=none", "data.num_samples=2",
                     "train.micro_batch_size=2", "train.max_steps=12", "scheduler=constant", "optimizer.lr=1e-2",
                     "train.final_checkpoint=false", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = run_dirs(workdir)[0]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Measured: 0.96 over the first four steps, 0.28 over the last four (12 steps, CI budget: 24 before).
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.5 * first, (first, last)
    assert any(t.ndim == 4 for t in lora_tensors(run_dir / "lora").values())  # conv adapters exported


def test_bad_adapter_values_get_one_screen(workdir: Path) -> None:
    result = run_cli("adapter=lora", "adapter.rank=0", "adapter.alpha=-1", "dry_run=true", cwd=workdir)
    assert result.returncode == 2
    assert "adapter.rank=0" in result.stderr and "adapter.alpha=-1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_target_matching_nothing_lists_the_module_names(workdir: Path) -> None:
    result = run_cli("adapter=lora", "adapter.targets=[to_q,attn_qkv]", "logger=none", cwd=workdir)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "adapter.targets=" in result.stderr and "attn_qkv" in result.stderr
    assert "to_out.0" in result.stderr and "proj_in" in result.stderr  # the names that exist
    assert "fix: adapter.targets=[to_q] (those of the list it has)" in result.stderr
    assert "Traceback" not in result.stderr


def test_lora_wide_on_a_transformer_is_refused_with_the_targets_it_has() -> None:
    """adapter=lora_wide names SDXL's proj_in, which Flux.1's transformer lacks: refused before the run (the wider
    matrix's cell), the fix the list without it, which trains."""
    from ds_trainer.train.adapters import adapter

    report = checks.check(make_cfg("model=flux_tiny", "adapter=lora_wide"))
    (problem,) = adapter.inspect(report.cfg)[0]
    assert problem.key == "adapter.targets" and problem.why.startswith("proj_in: no Linear/Conv module"), problem
    assert problem.fix.startswith("adapter.targets=[to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_out]")
    fixed = checks.check(make_cfg("model=flux_tiny", "adapter=lora_wide",
                                  "adapter.targets=[to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_out]"))
    assert adapter.inspect(fixed.cfg)[0] == []


# --- in one process: what the DeepSpeed engine holds for a LoRA

@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    pytest.importorskip("deepspeed")
    with one_rank_process_group(free_port()):
        yield


@pytest.mark.slow
def test_engine_trains_adapters_only_with_optimizer_state_for_them(one_rank_group: None, tmp_path: Path) -> None:
    import deepspeed

    from ds_trainer import cli
    from ds_trainer.tools.plan import unet_inputs
    from ds_trainer.train.adapters import adapter
    from ds_trainer.train.families import sdxl

    cfg = make_cfg(*LORA, f"paths.outputs={tmp_path}", "zero=stage2", "optimizer.lr=1e-2", "scheduler=constant")
    cfg, ds = cli.prepare(cfg, tmp_path / "run")
    unet = sdxl.load_unet(cfg)
    trained = adapter.build(cfg, unet)
    frozen = {n: p.detach().clone() for n, p in unet.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in unet.named_parameters() if p.requires_grad}
    assert all(v.dtype == torch.bfloat16 for v in frozen.values())  # no fp32 copy of the frozen base
    engine, *_ = deepspeed.initialize(model=unet, model_parameters=trained.parameters, config=ds)
    for _ in range(2):
        latents, t, embeds, cond = unet_inputs(unet.config, 1, 128, 128, dtype=torch.bfloat16)
        loss = engine(latents, t, embeds, added_cond_kwargs=cond).sample.float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    named = dict(engine.module.named_parameters())
    assert all(torch.equal(named[n], v) for n, v in frozen.items()), "a frozen base weight changed"
    assert any(not torch.equal(named[n].float(), v.float()) for n, v in adapters.items()), "no adapter moved"
    count = trained.count()
    state = engine.optimizer.optimizer.state
    moments = sum(t.numel() * t.element_size() for s in state.values() for k, t in s.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    masters = sum(t.numel() * t.element_size() for t in engine.optimizer.single_partition_of_fp32_groups)
    assert count * 8 <= moments <= count * 8 + 4096 and count * 4 <= masters <= count * 4 + 2048, (count, moments,
                                                                                                   masters)
