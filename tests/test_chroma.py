"""Chroma (`model=chroma_tiny`; `model=chroma` is Chroma1-HD's architecture on meta for the planner): its encoding
against ChromaPipeline's own (T5 with its attention mask, the one padding token it keeps, the joint mask, the
scheduler's shift line), its single file against diffusers' Chroma converter (the makers' layout ComfyUI loads), its
kohya LoRA against diffusers' kohya converter and ComfyUI's rule; then the chain of runs (tests/helpers/chain.py):
ZeRO-3 on two ranks samples what the exported ChromaPipeline makes, DDP and FSDP2 resume it within noise, a LoRA
trained under FSDP2 loads into ChromaPipeline and its kohya file is the same LoRA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import chain, numerics, pipelines
from helpers.cfg import make_cfg

torch = pytest.importorskip("torch")

MODEL = "chroma_tiny"
ASSETS = Path(__file__).parents[1] / "ds_trainer" / "assets"


@pytest.fixture(scope="module")
def runs(module_tmp: Callable[[str], Path]) -> Callable[[str], Path]:
    return chain.runs(module_tmp("chroma"), MODEL)


def test_chromas_captions_mask_and_shift_are_its_pipelines() -> None:
    """T5's states of each caption encoded with its attention mask, and the mask the transformer is given (the
    caption's tokens and the first padding one), as ChromaPipeline makes them; the joint text-and-image mask; the
    noise levels shifted on the scheduler's line; the transformer's call sees them."""
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

    from ds_trainer.train.families import chroma, flow, of

    cfg = make_cfg(f"model={MODEL}")
    family = of(cfg)
    frozen = family.load_frozen(cfg)
    pipe = ChromaPipeline(scheduler=None, vae=frozen.vae, text_encoder=frozen.text_encoder,
                          tokenizer=frozen.tokenizer, transformer=None)
    prompts = ["a red cube", "a small green circle on a dark background at night"]
    ours = family.text_inputs(frozen, prompts, torch.device("cpu"))
    theirs, mask = pipe._get_t5_prompt_embeds(prompts, max_sequence_length=32, device=torch.device("cpu"))
    assert torch.equal(ours["prompt_embeds"], theirs) and torch.equal(ours["prompt_mask"].float(), mask)
    kept = ours["prompt_mask"].sum(dim=1)
    assert 2 <= kept[0] < kept[1] < 32  # a caption's tokens and one padding token; the rest masked
    joint = chroma.joint_mask(ours["prompt_mask"], 16, torch.float32)
    assert torch.equal(joint, pipe._prepare_attention_mask(2, 16, torch.float32, mask))
    schedule = family.schedule(cfg)
    sampler = FlowMatchEulerDiscreteScheduler.from_pretrained(cfg.model.architecture, subfolder="scheduler")
    index = torch.tensor([0, 300, 999])
    for tokens in (16, 1024):
        m = flow.mu(tokens)  # Flux's line: Chroma's scheduler keeps it
        assert torch.allclose(schedule.sigma(index, tokens).double(),
                              sampler.time_shift(m, 1.0, (1000 - index.double()) / 1000), atol=1e-6)
    seen: dict[str, Any] = {}
    model = family.load_trained(cfg)
    model.register_forward_hook(lambda _m, _args, kwargs, _out: seen.update(kwargs), with_kwargs=True)
    latents = family.encode_images(frozen, torch.rand(2, 3, 64, 64) * 2 - 1)
    losses = family.losses(model, schedule, {"latents": latents, **ours}, torch.randn_like(latents),
                           torch.tensor([10, 900]), torch.device("cpu"), torch.float32)
    assert latents.shape == (2, 4, 8, 8) and losses.shape == (2,) and bool(torch.isfinite(losses).all())
    assert seen["attention_mask"].shape == (2, 32 + 16) and torch.equal(seen["attention_mask"][:, 32:],
                                                                         torch.ones(2, 16))


def _real(**config: Any) -> Any:
    """Chroma1-HD's transformer (its config changed), on the meta device."""
    from diffusers import ChromaTransformer2DModel

    with torch.device("meta"):
        return ChromaTransformer2DModel.from_config(
            {**ChromaTransformer2DModel.load_config(str(ASSETS / "chroma"), subfolder="transformer"), **config})


def test_the_single_file_is_what_diffusers_chroma_converter_reads_every_tensor_of() -> None:
    """Chroma1-HD's transformer (on meta) in the makers' layout: diffusers' converter (what its from_single_file
    reads ComfyUI's Chroma1-HD.safetensors with) takes every tensor of the file and gives back every tensor of the
    model, in its shape."""
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    from ds_trainer.train.export import single_file

    model = _real()
    file = single_file.denoiser_tensors("chroma", model)
    assert "distilled_guidance_layer.norms.4.scale" in file and "double_blocks.18.img_attn.qkv.weight" in file
    left = dict(file)
    converted = convert_chroma_transformer_checkpoint_to_diffusers(left)
    assert left == {}
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape)
                                                                for k, v in model.state_dict().items()}


def test_diffusers_reads_the_kohya_lora_at_chromas_width_to_the_same_deltas(tmp_path: Path) -> None:
    """ChromaPipeline.lora_state_dict (diffusers' kohya converter, Chroma's width alone: a one-block Chroma1-HD on
    meta, the LoRA tensors alone real) splits the kohya file's fused qkv and linear1 back into the same deltas."""
    from diffusers import ChromaPipeline
    from safetensors.torch import save_file

    from ds_trainer.train import families
    from ds_trainer.train.layouts import kohya

    model = _real(num_layers=1, num_single_layers=1)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    gen, adapters = torch.Generator().manual_seed(0), {}
    for key, shape in shapes.items():
        module = key.removesuffix(".weight")
        if module.endswith(("to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "ff.net.2")) and len(shape) == 2:
            adapters[module] = (torch.randn(4, shape[1], generator=gen), torch.randn(shape[0], 4, generator=gen), 2.0)
    path = tmp_path / "chroma_kohya.safetensors"
    save_file(kohya.write("transformer", families.named("chroma").kohya_parts(shapes, model.config), adapters,
                          shapes), str(path))
    state = ChromaPipeline.lora_state_dict(str(path))
    state = state[0] if isinstance(state, tuple) else state
    for module, (a, b, alpha) in adapters.items():
        key = f"transformer.{module}"
        delta = state[key + ".lora_B.weight"].float() @ state[key + ".lora_A.weight"].float()
        torch.testing.assert_close(delta, alpha / 4 * (b @ a), rtol=1e-4, atol=1e-4, msg=module)


@pytest.mark.parametrize(("change", "says", "fix"), [
    (["model.flow.guidance=3.5"], "has no guidance input", "model.flow.guidance=null"),
    (["data.text_encoder_dropout.t5=0.2"], "chroma has this one encoder alone", "data.caption_dropout=0.2"),
    (["model.flow.t5_max_length=1024"], "out of range", "model.flow.t5_max_length=256"),
])
def test_what_chroma_cannot_take_is_refused_with_the_fix(change: list[str], says: str, fix: str) -> None:
    from ds_trainer.config import checks

    report = checks.check(make_cfg(f"model={MODEL}", *change))
    shown = report.render()
    assert not report.ok and says in shown and fix in shown, shown


def test_a_flux_file_is_named_for_chroma_and_a_chroma_file_for_flux(tmp_path: Path) -> None:
    """Chroma's file keeps Flux.1's blocks (Flux.1's mark): each family's check of a `model.transformer` file names
    the other's file; a tiny Chroma's own is refused for its width (diffusers' loader reads Chroma1-HD's alone)."""
    from safetensors.torch import save_file

    from ds_trainer.config import checks, weights_file
    from ds_trainer.train import families
    from ds_trainer.train.export import single_file

    files, arches = {}, {}
    for model in ("chroma_tiny", "flux_tiny"):
        cfg = make_cfg(f"model={model}", "train.seed=5")
        module = families.of(cfg).load_trained(cfg)
        files[model], arches[model] = tmp_path / f"{model}.safetensors", dict(module.config)
        save_file({k: v.contiguous() for k, v in single_file.denoiser_tensors(cfg.model.family.value, module).items()},
                  files[model])
    header = {m: weights_file.safetensors_header(path) for m, path in files.items()}
    assert weights_file.transformer_mismatch(header["chroma_tiny"], "chroma", arches["chroma_tiny"]) is None
    assert weights_file.transformer_mismatch(header["flux_tiny"], "flux", arches["flux_tiny"]) is None
    assert weights_file.transformer_mismatch(header["flux_tiny"], "chroma", arches["chroma_tiny"]) == (
        "a Flux.1 transformer (Black Forest Labs' layout), not chroma's")
    assert weights_file.transformer_mismatch(header["chroma_tiny"], "flux", arches["flux_tiny"]) == (
        "a Chroma transformer (its makers' layout, as Chroma1-HD.safetensors), not flux's")
    (width,) = checks.check(make_cfg(f"model={MODEL}", f"model.transformer={files[MODEL]}")).problems
    assert "reads Chroma's width (3072) only" in width.why and width.fix.startswith("model=chroma ")


@pytest.mark.long
def test_a_chroma_transformer_at_its_width_reads_from_its_makers_file(tmp_path: Path) -> None:
    """At Chroma1-HD's width (one block of each kind, a small approximator: 340 M parameters), `model.transformer`
    reads the exported single file through diffusers' loader to the weights it was written from."""
    import shutil

    from diffusers import ChromaTransformer2DModel
    from safetensors.torch import save_file

    from ds_trainer.config import checks
    from ds_trainer.train import families
    from ds_trainer.train.export import single_file

    config = {**_real().config, "num_layers": 1, "num_single_layers": 1, "approximator_hidden_dim": 64}
    torch.manual_seed(0)
    module = ChromaTransformer2DModel.from_config(config)
    arch = tmp_path / "arch"
    shutil.copytree(make_cfg(f"model={MODEL}").model.architecture, arch)
    module.save_config(arch / "transformer")
    path = tmp_path / "chroma.safetensors"
    save_file(single_file.denoiser_tensors("chroma", module), path)
    cfg = make_cfg(f"model={MODEL}", f"model.architecture={arch}", f"model.transformer={path}")
    assert not checks.check(cfg).problems
    loaded = families.of(cfg).load_trained(cfg)
    assert numerics.mean_abs_difference(loaded.state_dict(), module.state_dict()) == 0


# --- the chain


@pytest.mark.slow
@pytest.mark.multiproc
def test_trains_under_zero3_on_two_ranks_and_samples_what_the_exported_pipeline_makes(
        runs: Callable[[str], Path]) -> None:
    from ds_trainer.train.export import single_file

    run_dir = runs("zero3_x2")
    item = chain.assert_zero3_run(run_dir, MODEL, "ChromaPipeline", {
        "prompt_embeds": (32, 64), "prompt_mask": (32,), "latents": (4, 8, 8)})
    assert "pooled" not in item
    # the single file: the exported transformer in its makers' layout (bf16, export.dtype)
    from diffusers import ChromaTransformer2DModel
    from safetensors.torch import load_file

    expected = single_file.denoiser_tensors("chroma", ChromaTransformer2DModel.from_pretrained(
        run_dir / "transformer"))
    file = load_file(run_dir / "single_file" / "model.safetensors")
    assert file.keys() == expected.keys() and all(torch.equal(file[k], v.bfloat16()) for k, v in expected.items())
    chain.assert_sample_is_the_pipelines(run_dir, bf16=True, max_sequence_length=32)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", chain.RESUMED)
def test_a_zero3_checkpoint_resumes_under_ddp_and_fsdp_within_noise(runs: Callable[[str], Path],
                                                                   layout: str) -> None:
    chain.assert_resumed(runs, layout, max_sequence_length=32)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_lora_trained_under_fsdp_loads_into_chromapipeline_and_its_kohya_file_is_the_same_lora(
        runs: Callable[[str], Path]) -> None:
    """The diffusers file changes the exported ChromaPipeline's image; the kohya file, merged by ComfyUI's rule into
    the makers' layout of the base, is the makers' layout of the base with the diffusers file fused."""
    from diffusers import ChromaPipeline
    from safetensors.torch import load_file

    from ds_trainer.train.export import single_file

    run_dir = runs("lora_fsdp_x2")
    losses = chain.losses(run_dir)
    assert sorted(losses) == list(range(1, 9))
    lora = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    pipe = pipelines.load(run_dir / "pipeline")
    assert type(pipe) is ChromaPipeline
    pipe.set_progress_bar_config(disable=True)
    base_file = {k: v.clone() for k, v in single_file.denoiser_tensors("chroma", pipe.transformer).items()}
    call = {"prompt": chain.PROMPT, "num_inference_steps": 2, "height": 64, "width": 64, "max_sequence_length": 32,
            "output_type": "np"}
    base = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    pipe.load_lora_weights(run_dir / "lora")
    adapted = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert abs(adapted - base).max() > 1e-3  # every adapted module found its tensors, and they change the image
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fused = single_file.denoiser_tensors("chroma", pipe.transformer)
    got = chain.comfy_merge(base_file, load_file(run_dir / "lora" / "kohya.safetensors"))
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in load_file(run_dir / "lora" / "kohya.safetensors")
    for key, value in fused.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
