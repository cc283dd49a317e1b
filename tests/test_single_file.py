"""`model.pretrained=<file>.safetensors`: a single-file SDXL checkpoint in the original (Stability) key
layout, written by the export's own code from sdxl_tiny's weights, loads to the same UNet and trains again (its run
exports the single file, which `python -m ds_trainer.convert --to single_file` writes too); `model.vae` replaces the
VAE."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs

torch = pytest.importorskip("torch")

@pytest.fixture(scope="module")
def files(module_tmp: Callable[[str], Path]) -> dict[str, Any]:
    from safetensors.torch import save_file

    from ds_trainer.train.export import single_file
    from ds_trainer.train.families import sdxl

    root = module_tmp("single_file")
    cfg = make_cfg("train.seed=3")
    unet, frozen = sdxl.load_unet(cfg), sdxl.load_frozen(cfg)
    checkpoint = root / "sdxl_tiny_original.safetensors"
    # The layout a run's export writes (train/export/single_file.py), without its VAE: model.vae gives one.
    state = single_file.tensors("sdxl", unet, {"vae": frozen.vae, "text_encoder": frozen.text_encoder,
                                               "text_encoder_2": frozen.text_encoder_2})
    save_file({k: v for k, v in state.items() if not k.startswith("first_stage_model.")}, checkpoint)
    torch.manual_seed(11)
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_config(frozen.vae.config)  # a VAE of its own, to tell the override apart
    vae.save_pretrained(root / "vae")
    save_file({"down_blocks.0.resnets.0.conv1.weight": torch.zeros(1)}, root / "diffusers_unet.safetensors")
    return {"root": root, "checkpoint": checkpoint, "vae": root / "vae", "unet": unet, "frozen": frozen}


def test_single_file_loads_the_unet_and_text_encoders_it_was_written_from(files: dict[str, Any]) -> None:
    from ds_trainer.train.families import sdxl

    cfg = make_cfg(f"model.pretrained={files['checkpoint']}", f"model.vae={files['vae']}")
    loaded, source = sdxl.load_unet(cfg).state_dict(), files["unet"].state_dict()
    assert loaded.keys() == source.keys() and all(torch.equal(loaded[k], source[k]) for k in source)
    frozen = sdxl.load_frozen(cfg)
    for ours, theirs in ((frozen.text_encoder, files["frozen"].text_encoder),
                         (frozen.text_encoder_2, files["frozen"].text_encoder_2)):
        a, b = ours.state_dict(), theirs.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b)
    vae = json.loads((files["vae"] / "config.json").read_text())
    assert vae["_class_name"] == "AutoencoderKL"
    from diffusers import AutoencoderKL

    expected = AutoencoderKL.from_pretrained(files["vae"]).state_dict()
    assert all(torch.equal(frozen.vae.state_dict()[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_training_from_a_single_file_exports_a_pipeline_and_bad_files_are_named(
        files: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    root = files["root"]
    result = run_cli("logger=none", "train.max_steps=1", "data.num_samples=2",
                     f"model.pretrained={files['checkpoint']}", f"model.vae={files['vae']}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = run_dirs(root)[0]
    pipeline = run_dir / "pipeline"
    assert {p.name for p in pipeline.iterdir()} >= {"unet", "vae", "text_encoder", "text_encoder_2", "tokenizer",
                                                    "scheduler", "model_index.json"}
    # The run's single file again, from its diffusers export, by `python -m ds_trainer.convert --to single_file`.
    from safetensors.torch import load_file

    from ds_trainer.tools import convert

    exported = load_file(run_dir / "single_file" / "model.safetensors")
    (run_dir / "single_file" / "model.safetensors").unlink()
    (run_dir / "README.md").unlink()
    # The documented line, as written, on a full fine-tune: the single file and the card, kohya's said skipped.
    assert convert.main([str(run_dir), "--to", "single_file,kohya,card"]) == 0
    assert "skipped kohya: a full fine-tune has no LoRA" in capsys.readouterr().out
    again = load_file(run_dir / "single_file" / "model.safetensors")
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)
    assert "# sdxl_tiny: fine-tune of" in (run_dir / "README.md").read_text()
    # And the UNet of its final checkpoint (portable state), by `convert <checkpoint> --unet`: the export's weights.
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
    assert convert.main([str(checkpoint), "--unet", str(root / "unet_again")]) == 0
    unet = load_file(root / "unet_again" / "diffusion_pytorch_model.safetensors")
    expected = load_file(run_dir / "unet" / "diffusion_pytorch_model.safetensors")
    assert unet.keys() == expected.keys() and all(torch.equal(unet[k], expected[k]) for k in expected)
    bad = run_cli(f"model.pretrained={root / 'diffusers_unet.safetensors'}", "dry_run=true", cwd=root)
    assert bad.returncode == 2 and "is not an SDXL checkpoint: a diffusers-format model" in bad.stderr
    no_vae = run_cli(f"model.pretrained={files['checkpoint']}", "dry_run=true", cwd=root)
    assert no_vae.returncode == 2 and "holds no VAE" in no_vae.stderr and "model.vae=" in no_vae.stderr
    # A .ckpt (a pickle) is read only when the run loads it: still the user's input, still exit 2, no traceback.
    ckpt = root / "not_sdxl.ckpt"
    torch.save({"state_dict": {"model.layer.weight": torch.zeros(2, 2)}}, ckpt)
    wrong = run_cli(f"model.pretrained={ckpt}", "logger=none", "train.max_steps=1", "data.num_samples=2", cwd=root)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr[-3000:]
    assert f"model.pretrained={ckpt} is not an SDXL checkpoint" in wrong.stderr
