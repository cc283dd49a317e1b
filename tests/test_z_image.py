"""Z-Image (`model=z_image_tiny`; `model=z_image` and `model=z_image_turbo` are the base and Turbo models'
architecture on meta for the planner): its encoding against ZImagePipeline's own (Qwen3's chat template, the
second-to-last hidden state, each caption its own length), its call of the transformer (lists of latents, the
timestep 1 - sigma, the output the pipeline negates: a transformer that returns training's target takes the
pipeline's one Euler step from noise to the image), its single file against diffusers' Z-Image converter and
loader (the makers' layout ComfyUI loads), the kohya LoRA by ComfyUI's rule; then the chain of runs
(tests/helpers/chain.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import chain, numerics, pipelines
from helpers.cfg import make_cfg

torch = pytest.importorskip("torch")

MODEL = "z_image_tiny"
ASSETS = Path(__file__).parents[1] / "ds_trainer" / "assets"


@pytest.fixture(scope="module")
def runs(module_tmp: Callable[[str], Path]) -> Callable[[str], Path]:
    return chain.runs(module_tmp("z_image"), MODEL)


def test_z_images_captions_are_its_pipelines_and_its_output_is_the_negated_velocity() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from ds_trainer.train.families import of

    cfg = make_cfg(f"model={MODEL}")
    family = of(cfg)
    frozen = family.load_frozen(cfg)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(cfg.model.architecture, subfolder="scheduler")
    model = family.load_trained(cfg).eval()
    pipe = ZImagePipeline(scheduler=scheduler, vae=frozen.vae, text_encoder=frozen.text_encoder,
                          tokenizer=frozen.tokenizer, transformer=model)
    prompts = ["a red cube", "a small green circle on a dark background at night"]
    ours = family.text_inputs(frozen, prompts, torch.device("cpu"))
    theirs = pipe._encode_prompt(list(prompts), device=torch.device("cpu"), max_sequence_length=32)
    kept = ours["prompt_mask"].bool()
    assert [int(k.sum()) for k in kept] == [len(t) for t in theirs] and len(theirs[0]) < len(theirs[1]) < 32
    assert all(torch.equal(ours["prompt_embeds"][i][kept[i]], theirs[i]) for i in range(2))
    assert not ours["prompt_embeds"][~kept].any()
    # Training's call: the transformer sees a list of (C, 1, H, W) latents, 1 - sigma and each caption's tokens
    seen: dict[str, Any] = {}
    model.register_forward_hook(lambda _m, args, _out: seen.update(args=args))
    latents = family.encode_images(frozen, torch.rand(2, 3, 64, 64) * 2 - 1)
    schedule = family.schedule(cfg)
    family.losses(model, schedule, {"latents": latents, **ours}, torch.randn_like(latents), torch.tensor([10, 900]),
                  torch.device("cpu"), torch.float32)
    x, t, caps = seen["args"]
    assert [tuple(v.shape) for v in x] == [(4, 1, 8, 8)] * 2 and [len(c) for c in caps] == [len(v) for v in theirs]
    assert torch.allclose(t, 1 - schedule.sigma(torch.tensor([10, 900])))
    # The pipeline negates the output before its Euler step: a transformer that returns training's target for
    # pure noise (x0 - noise) takes one step from sigma 1 to the image itself
    x0, noise = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    model.register_forward_hook(lambda _m, _args, _out: ([x0[0, :, None] - noise[0, :, None]],))
    got = pipe("a red cube", height=64, width=64, num_inference_steps=1, guidance_scale=0.0, latents=noise,
               max_sequence_length=32, output_type="latent").images
    torch.testing.assert_close(got, x0, rtol=0, atol=1e-5)


def test_the_single_file_is_the_makers_layout_diffusers_reads_back(tmp_path: Path) -> None:
    """The real transformer (on meta) in the makers' layout: diffusers' converter takes every tensor and gives every
    tensor of the model back; a tiny one's file reads back through `model.transformer` to its weights, and a
    Z-Image file is named for another family."""
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
    from safetensors.torch import save_file

    from ds_trainer.config import checks
    from ds_trainer.train import families
    from ds_trainer.train.export import single_file

    with torch.device("meta"):
        real = ZImageTransformer2DModel.from_config(ZImageTransformer2DModel.load_config(
            str(ASSETS / "z_image"), subfolder="transformer"))
    file = single_file.denoiser_tensors("z_image", real)
    assert {"layers.29.attention.qkv.weight", "x_embedder.weight", "final_layer.linear.weight"} <= set(file)
    left = dict(file)
    converted = convert_z_image_transformer_checkpoint_to_diffusers(left)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape)
                                                                for k, v in real.state_dict().items()}
    cfg = make_cfg(f"model={MODEL}", "train.seed=5")
    module = families.of(cfg).load_trained(cfg)
    path = tmp_path / "z_image.safetensors"
    save_file({k: v.contiguous() for k, v in single_file.denoiser_tensors("z_image", module).items()}, path)
    cfg = make_cfg(f"model={MODEL}", f"model.transformer={path}")
    assert not checks.check(cfg).problems
    loaded = families.of(cfg).load_trained(cfg)
    assert numerics.mean_abs_difference(loaded.state_dict(), module.state_dict()) == 0
    (problem,) = checks.check(make_cfg("model=qwen_image_tiny", f"model.transformer={path}")).problems
    assert "a Z-Image transformer (its makers' layout" in problem.why, problem


@pytest.mark.parametrize(("change", "says", "fix"), [
    (["precision=fp16"], "leaves fp16's range", "precision=bf16"),
    (["model.flow.dynamic_shift=true", "model.flow.shift=1.0"], "z_image's sampler shifts by the fixed",
     "model.flow.dynamic_shift=false"),
    (["model.flow.guidance=3.5"], "has no guidance input", "model.flow.guidance=null"),
])
def test_what_z_image_cannot_take_is_refused_with_the_fix(change: list[str], says: str, fix: str) -> None:
    from ds_trainer.config import checks

    report = checks.check(make_cfg(f"model={MODEL}", *change))
    shown = report.render()
    assert not report.ok and says in shown and fix in shown, shown


# --- the chain


@pytest.mark.slow
@pytest.mark.multiproc
def test_trains_under_zero3_on_two_ranks_and_samples_what_the_exported_pipeline_makes(
        runs: Callable[[str], Path]) -> None:
    from safetensors.torch import load_file

    run_dir = runs("zero3_x2")
    chain.assert_zero3_run(run_dir, MODEL, "ZImagePipeline", {
        "prompt_embeds": (32, 32), "prompt_mask": (32,), "latents": (4, 8, 8)})
    file = load_file(run_dir / "single_file" / "model.safetensors")
    assert "layers.1.attention.qkv.weight" in file and file["x_embedder.weight"].dtype == torch.bfloat16
    chain.assert_sample_is_the_pipelines(run_dir, bf16=True, max_sequence_length=32)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", chain.RESUMED)
def test_a_zero3_checkpoint_resumes_under_ddp_and_fsdp_within_noise(runs: Callable[[str], Path],
                                                                   layout: str) -> None:
    chain.assert_resumed(runs, layout, max_sequence_length=32)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_lora_trained_under_fsdp_loads_into_zimagepipeline_and_its_kohya_file_is_the_same_lora(
        runs: Callable[[str], Path]) -> None:
    """The diffusers file changes the exported ZImagePipeline's image; the kohya file (ComfyUI's names, q, k and v
    fused), merged by ComfyUI's rule into the makers' layout of the base, is that layout of the fused base."""
    from diffusers import ZImagePipeline
    from safetensors.torch import load_file

    from ds_trainer.train.export import single_file

    run_dir = runs("lora_fsdp_x2")
    assert sorted(chain.losses(run_dir)) == list(range(1, 9))
    lora = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora)
    pipe = pipelines.load(run_dir / "pipeline")
    assert type(pipe) is ZImagePipeline
    pipe.set_progress_bar_config(disable=True)
    base_file = {k: v.clone() for k, v in single_file.denoiser_tensors("z_image", pipe.transformer).items()}
    call = {"prompt": chain.PROMPT, "num_inference_steps": 2, "height": 64, "width": 64, "max_sequence_length": 32,
            "output_type": "np"}
    base = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    pipe.load_lora_weights(run_dir / "lora")
    adapted = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert abs(adapted - base).max() > 1e-3  # every adapted module found its tensors, and they change the image
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    kohya = load_file(run_dir / "lora" / "kohya.safetensors")
    assert "lora_unet_layers_0_attention_qkv.lora_down.weight" in kohya
    got = chain.comfy_merge(base_file, kohya)
    for key, value in single_file.denoiser_tensors("z_image", pipe.transformer).items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
