"""FLUX.2 (`model=flux2_tiny` for [dev], `flux2_klein_tiny` for [klein]; `flux2_dev`, `flux2_klein_4b` and
`flux2_klein_9b` are the real architectures on meta for the planner): its encoding against Flux2Pipeline's and
Flux2KleinPipeline's own (the language models' stacked hidden states over their chat templates; the VAE's
patchified latents normalised by its batch-norm statistics; the packed tokens and 4-axis ids), the guidance input
[dev] has and [klein] not, its single file against diffusers' FLUX.2 converter and loader (Black Forest Labs'
layout, as ComfyUI loads it), its kohya LoRA against diffusers' kohya converter; then the chain of runs
(tests/helpers/chain.py) on [dev]: ZeRO-3 on two ranks samples what the exported Flux2Pipeline makes, DDP and FSDP2
resume it within noise; and a [klein] LoRA trained under FSDP2 that loads into Flux2KleinPipeline, its kohya file
the same LoRA by ComfyUI's rule and by diffusers' reader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import chain, numerics, pipelines
from helpers.cfg import make_cfg

torch = pytest.importorskip("torch")

DEV, KLEIN = "flux2_tiny", "flux2_klein_tiny"
ASSETS = Path(__file__).parents[1] / "ds_trainer" / "assets"
# the klein LoRA's modules: the image stream's attention, one of the text stream's fused q, k, v (the others'
# rows zero in the kohya file's qkv), and the single blocks' fused projection
TARGETS = "adapter.targets=[to_q,to_k,to_v,to_out.0,add_k_proj,to_qkv_mlp_proj]"


@pytest.fixture(scope="module")
def runs(module_tmp: Callable[[str], Path]) -> Callable[[str], Path]:
    return chain.runs(module_tmp("flux2"), DEV)


@pytest.fixture(scope="module")
def klein_runs(module_tmp: Callable[[str], Path]) -> Callable[[str], Path]:
    return chain.runs(module_tmp("flux2_klein"), KLEIN, per_run={"lora_fsdp_x2": [TARGETS]})


@pytest.mark.parametrize("model", [DEV, KLEIN])
def test_captions_latents_and_ids_are_the_pipelines_and_the_guidance_input_is_devs(model: str) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    from ds_trainer.train.families import flow, flux2, of

    cfg = make_cfg(f"model={model}")
    family, length = of(cfg), int(cfg.model.flow.text_max_length)
    frozen = family.load_frozen(cfg)
    prompts = ["a red cube", "a small green circle on a dark background at night"]
    ours = family.text_inputs(frozen, prompts, torch.device("cpu"))["prompt_embeds"]
    if model == DEV:
        theirs = Flux2Pipeline._get_mistral_3_small_prompt_embeds(frozen.text_encoder, frozen.tokenizer, prompts,
                                                                    max_sequence_length=length)
    else:
        theirs = Flux2KleinPipeline._get_qwen3_prompt_embeds(frozen.text_encoder, frozen.tokenizer, prompts,
                                                              max_sequence_length=length)
    assert ours.shape == (2, length, 96) and torch.equal(ours, theirs)
    frozen.vae.bn.running_mean.normal_()  # statistics that change the latents (a fresh VAE's are 0 and 1)
    frozen.vae.bn.running_var.uniform_(0.5, 2.0)
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    latents = family.encode_images(frozen, pixels)
    pipe = Flux2Pipeline(scheduler=None, vae=frozen.vae, text_encoder=None, tokenizer=None, transformer=None)
    assert latents.shape == (2, 16, 4, 4) and torch.equal(latents, pipe._encode_vae_image(pixels, None))
    assert torch.equal(flux2.pack(latents), pipe._pack_latents(latents))
    assert torch.equal(flux2.image_ids(4, 4), pipe._prepare_latent_ids(latents)[0].float())
    assert torch.equal(flux2.text_ids(length), pipe._prepare_text_ids(ours)[0].float())
    sampler = FlowMatchEulerDiscreteScheduler.from_pretrained(cfg.model.architecture, subfolder="scheduler")
    schedule, index = family.schedule(cfg), torch.tensor([0, 300, 999])
    assert torch.allclose(schedule.sigma(index, 16).double(),
                          sampler.time_shift(flow.mu(16), 1.0, (1000 - index.double()) / 1000), atol=1e-6)
    seen: dict[str, Any] = {}
    transformer = family.load_trained(cfg)
    transformer.register_forward_hook(lambda _m, _args, kwargs, _out: seen.update(kwargs), with_kwargs=True)
    losses = family.losses(transformer, schedule, {"latents": latents, "prompt_embeds": ours},
                           torch.randn_like(latents), torch.tensor([10, 900]), torch.device("cpu"), torch.float32)
    assert losses.shape == (2,) and bool(torch.isfinite(losses).all())
    # the ids carry a batch axis of one (context parallelism splits them along their tokens; FLUX.2 reads the first)
    assert seen["hidden_states"].shape == (2, 16, 16) and seen["img_ids"].shape == (1, 16, 4)
    if model == DEV:
        assert torch.equal(seen["guidance"], torch.full((2,), 3.5))
    else:
        assert seen["guidance"] is None


def test_under_autocast_it_trains_on_the_timestep_and_guidance_a_bf16_transformer_sees() -> None:
    """diffusers' FLUX.2 casts the timestep and the guidance to its hidden states' dtype before multiplying by 1000:
    DDP's float32 masters under autocast (hidden states in float32) are given them rounded as the bf16 transformer
    of ZeRO-3, FSDP2 and a bf16 pipeline rounds them, so the losses agree (unrounded, they differ by ~0.5%)."""
    import copy

    from ds_trainer.train.families import of

    cfg = make_cfg(f"model={DEV}")
    family = of(cfg)
    frozen = family.load_frozen(cfg)
    batch = {"latents": family.encode_images(frozen, torch.rand(2, 3, 64, 64) * 2 - 1),
             **family.text_inputs(frozen, ["a red cube", "a cat"], torch.device("cpu"))}
    model, schedule, t = family.load_trained(cfg), family.schedule(cfg), torch.tensor([123, 777])
    with torch.no_grad():
        for p in model.parameters():  # away from the init, where the timestep's embedding matters more
            p.add_(torch.randn_like(p) * 0.05)
    noise, cpu = torch.randn_like(batch["latents"]), torch.device("cpu")
    bf16 = family.losses(copy.deepcopy(model).bfloat16(), schedule, batch, noise, t, cpu, torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):
        autocast = family.losses(model, schedule, batch, noise, t, cpu, torch.float32)
    torch.testing.assert_close(autocast, bf16.float(), rtol=1e-3, atol=0)


def _real(name: str, **config: Any) -> Any:
    """A real FLUX.2 transformer (its config changed), on the meta device."""
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        return Flux2Transformer2DModel.from_config(
            {**Flux2Transformer2DModel.load_config(str(ASSETS / name), subfolder="transformer"), **config})


@pytest.mark.parametrize("name", ["flux2_dev", "flux2_klein_9b"])
def test_the_single_file_is_what_diffusers_flux2_converter_reads_every_tensor_of(name: str) -> None:
    """The real transformer (on meta) in Black Forest Labs' layout: diffusers' converter (what from_single_file
    reads flux2-dev.safetensors with) takes every tensor of the file and gives back every tensor of the model."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    from ds_trainer.train.export import single_file

    model = _real(name)
    file = single_file.denoiser_tensors("flux2", model)
    assert {"single_stream_modulation.lin.weight", "double_blocks.7.txt_attn.qkv.weight",
            "single_blocks.23.linear1.weight", "final_layer.adaLN_modulation.1.weight"} <= set(file)
    assert ("guidance_in.in_layer.weight" in file) == (name == "flux2_dev")
    left = dict(file)
    converted = convert_flux2_transformer_checkpoint_to_diffusers(left)
    assert left == {}
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape)
                                                                for k, v in model.state_dict().items()}


def test_a_tiny_transformers_file_reads_back_and_each_file_is_named_for_its_family(tmp_path: Path) -> None:
    """`model.transformer` reads the exported file through diffusers' loader to the weights it was written from;
    a Flux.1 file is named for FLUX.2 and a FLUX.2 one for Flux.1; [dev]'s file is refused for [klein]'s
    architecture by its guidance input."""
    from safetensors.torch import save_file

    from ds_trainer.config import checks, weights_file
    from ds_trainer.train import families
    from ds_trainer.train.export import single_file

    files, modules = {}, {}
    for model in (DEV, "flux_tiny"):
        cfg = make_cfg(f"model={model}", "train.seed=5")
        modules[model] = families.of(cfg).load_trained(cfg)
        files[model] = tmp_path / f"{model}.safetensors"
        save_file({k: v.contiguous() for k, v in
                   single_file.denoiser_tensors(cfg.model.family.value, modules[model]).items()}, files[model])
    cfg = make_cfg(f"model={DEV}", f"model.transformer={files[DEV]}")
    assert not checks.check(cfg).problems
    loaded = families.of(cfg).load_trained(cfg)
    assert numerics.mean_abs_difference(loaded.state_dict(), modules[DEV].state_dict()) == 0
    header = {m: weights_file.safetensors_header(path) for m, path in files.items()}
    assert weights_file.transformer_mismatch(header[DEV], "flux", dict(modules["flux_tiny"].config)) == (
        "a FLUX.2 transformer (Black Forest Labs' layout, as flux2-dev.safetensors), not flux's")
    (problem,) = checks.check(make_cfg(f"model={DEV}", f"model.transformer={files['flux_tiny']}")).problems
    assert "a Flux.1 transformer" in problem.why, problem
    (problem,) = checks.check(make_cfg(f"model={KLEIN}", f"model.transformer={files[DEV]}")).problems
    assert "with a guidance input ([dev] has one, [klein] not), the architecture without" in problem.why, problem


def test_diffusers_reads_the_kohya_lora_to_the_same_deltas(tmp_path: Path) -> None:
    """Flux2Pipeline.lora_state_dict (diffusers' kohya FLUX.2 converter) splits the kohya file's fused qkv back into
    the same deltas, and reads the single blocks' fused projection as it was trained."""
    from diffusers import Flux2Pipeline
    from safetensors.torch import save_file

    from ds_trainer.train import families
    from ds_trainer.train.layouts import kohya

    model = _real(KLEIN)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    gen, adapters = torch.Generator().manual_seed(0), {}
    for key, shape in shapes.items():
        module = key.removesuffix(".weight")
        if module.endswith(("to_q", "to_k", "to_v", "to_out.0", "add_v_proj", "to_qkv_mlp_proj", "ff.linear_in")):
            adapters[module] = (torch.randn(4, shape[1], generator=gen), torch.randn(shape[0], 4, generator=gen), 2.0)
    path = tmp_path / "flux2_kohya.safetensors"
    save_file(kohya.write("transformer", families.named("flux2").kohya_parts(shapes, model.config), adapters,
                          shapes), str(path))
    state = Flux2Pipeline.lora_state_dict(str(path))
    state = state[0] if isinstance(state, tuple) else state
    for module, (a, b, alpha) in adapters.items():
        key = f"transformer.{module}"
        delta = state[key + ".lora_B.weight"].float() @ state[key + ".lora_A.weight"].float()
        torch.testing.assert_close(delta, alpha / 4 * (b @ a), rtol=1e-4, atol=1e-4, msg=module)


@pytest.mark.parametrize(("model", "change", "says", "fix"), [
    (KLEIN, ["model.flow.guidance=3.5"], "transformer has no guidance input", "model.flow.guidance=null"),
    (DEV, ["model.flow.guidance=null"], "transformer takes guidance input", "model.flow.guidance=3.5"),
    (DEV, ["samples=on", "samples.negative_prompt=blurry"], "take no negative prompt", "samples.negative_prompt=''"),
    (DEV, ["precision=fp16"], "leaves fp16's range", "precision=bf16"),
    (KLEIN, ["data.text_encoder_dropout.t5=0.2"], "has no t5 text encoder (flux2's: llm)",
     "data.text_encoder_dropout.llm=0.2"),
])
def test_what_flux2_cannot_take_is_refused_with_the_fix(model: str, change: list[str], says: str, fix: str) -> None:
    from ds_trainer.config import checks

    report = checks.check(make_cfg(f"model={model}", *change))
    shown = report.render()
    assert not report.ok and says in shown and fix in shown, shown


@pytest.mark.parametrize(("model", "license_lines"), [
    ("flux2_dev", ["license: other", "license_name: flux-dev-non-commercial-license"]),
    ("flux2_klein_4b", ["license: apache-2.0", "base_model: black-forest-labs/FLUX.2-klein-base-4B"]),
    ("flux2_klein_9b", ["license: other", "license_name: flux-non-commercial-license"]),
])
def test_the_model_card_names_the_bases_license(tmp_path: Path, model: str, license_lines: list[str]) -> None:
    """The card's front matter carries the base's license as the hub names it ([dev]'s and [klein] 9B's
    non-commercial ones), its text the license's page."""
    from ds_trainer.train.export import card

    run_dir = tmp_path / "outputs" / "run"
    run_dir.mkdir(parents=True)
    text = card.text(make_cfg(f"model={model}", "adapter=lora"), run_dir, {}, [])
    front = text.split("---")[1].splitlines()
    assert set(license_lines) <= set(front), front
    assert "The base model's license applies: https://huggingface.co/black-forest-labs/FLUX.2-" in text


# --- the chain


@pytest.mark.slow
@pytest.mark.multiproc
def test_trains_under_zero3_on_two_ranks_and_samples_what_the_exported_pipeline_makes(
        runs: Callable[[str], Path]) -> None:
    from safetensors.torch import load_file

    run_dir = runs("zero3_x2")
    # the patchified latents: 1/16 of the image
    chain.assert_zero3_run(run_dir, DEV, "Flux2Pipeline", {"prompt_embeds": (64, 96), "latents": (16, 4, 4)})
    file = load_file(run_dir / "single_file" / "model.safetensors")
    assert "double_blocks.0.img_attn.qkv.weight" in file and file["img_in.weight"].dtype == torch.bfloat16
    chain.assert_sample_is_the_pipelines(run_dir, bf16=True, max_sequence_length=64)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", chain.RESUMED)
def test_a_zero3_checkpoint_resumes_under_ddp_and_fsdp_within_noise(runs: Callable[[str], Path],
                                                                   layout: str) -> None:
    chain.assert_resumed(runs, layout, max_sequence_length=64)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_klein_lora_trained_under_fsdp_loads_into_its_pipeline_and_its_kohya_file_is_the_same_lora(
        klein_runs: Callable[[str], Path]) -> None:
    """The diffusers file changes the exported Flux2KleinPipeline's image; the kohya file, read by diffusers,
    makes that image too, and merged by ComfyUI's rule into Black Forest Labs' layout of the base, it is that
    layout of the base with the diffusers file fused."""
    from diffusers import Flux2KleinPipeline
    from safetensors.torch import load_file

    from ds_trainer.train.export import single_file

    run_dir = klein_runs("lora_fsdp_x2")
    assert sorted(chain.losses(run_dir)) == list(range(1, 9))
    lora = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora)
    pipe = pipelines.load(run_dir / "pipeline")
    assert type(pipe) is Flux2KleinPipeline and not pipe.config.is_distilled
    pipe.set_progress_bar_config(disable=True)
    base_file = {k: v.clone() for k, v in single_file.denoiser_tensors("flux2", pipe.transformer).items()}
    call = {"prompt": chain.PROMPT, "num_inference_steps": 2, "height": 64, "width": 64, "max_sequence_length": 32,
            "output_type": "np"}
    base = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    pipe.load_lora_weights(run_dir / "lora")
    adapted = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert abs(adapted - base).max() > 1e-3  # every adapted module found its tensors, and they change the image
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    kohya = load_file(run_dir / "lora" / "kohya.safetensors")
    assert {"lora_unet_double_blocks_0_txt_attn_qkv.lora_down.weight",
            "lora_unet_single_blocks_0_linear1.lora_down.weight"} <= set(kohya)
    got = chain.comfy_merge(base_file, kohya)
    for key, value in single_file.denoiser_tensors("flux2", pipe.transformer).items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
    fresh = pipelines.load(run_dir / "pipeline")
    fresh.set_progress_bar_config(disable=True)
    fresh.load_lora_weights(str(run_dir / "lora" / "kohya.safetensors"))
    from_kohya = fresh(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert abs(from_kohya - adapted).max() < 1e-3
