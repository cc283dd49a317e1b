"""Qwen-Image-Edit-2509/2511: an editing model of several reference images a sample (`model=qwen_image_edit_plus_tiny`,
2511's transformer at a tiny size; `model.references`: up to 3, QwenImageEditPlusPipeline's). The data pairs image
`<name>` with `<name>_0`, `<name>_1`, ... in the control folder (musubi-tuner's layout; a table cell's list), an image
with more than model.references or none is skipped and named, and samples of one reference count batch together;
the captions are encoded as the pipeline encodes them (`Picture N:` before the caption, each reference at about
384 x 384); what cannot hold several references is refused with the fix. Then the chain of runs
(tests/helpers/chain.py): the sample from two references is the exported QwenImageEditPlusPipeline's, resumes within
noise, a LoRA that loads into the pipeline."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import chain, numerics, pipelines
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from PIL import Image

from ds_trainer.config import checks

torch = pytest.importorskip("torch")

MODEL = "qwen_image_edit_plus_tiny"


def _picture(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, (240, 240, 240))
    image.paste(colour, (size[0] // 4, size[1] // 4, size[0] * 3 // 4, size[1] * 3 // 4))
    image.save(path)
    return path


@pytest.fixture(scope="module")
def references(module_tmp: Callable[[str], Path]) -> Path:
    """images/a (references a_0, a_1), b (b_0000 alone), c (four: one too many), d (none); and two
    sample references of other shapes."""
    root = module_tmp("edit_plus_data")
    for name in "abcd":
        _picture(root / "images" / f"{name}.png", (64, 64), (220, 40, 40))
        (root / "images" / f"{name}.txt").write_text("make the square red")
    for rel, colour in (("a_0.png", (40, 80, 220)), ("a_1.jpg", (40, 180, 60)), ("b_0000.png", (200, 200, 40)),
                        *((f"c_{n}.png", (90, 90, 90)) for n in range(4))):
        _picture(root / "references" / rel, (96, 64), colour)
    _picture(root / "samples" / "first.png", (96, 128), (40, 80, 220))
    _picture(root / "samples" / "second.png", (128, 96), (40, 180, 60))
    return root


@pytest.fixture(scope="module")
def runs(module_tmp: Callable[[str], Path], references: Path) -> Callable[[str], Path]:
    both = f"samples.images=[{references / 'samples' / 'first.png'}+{references / 'samples' / 'second.png'}]"
    # DDP's EMA run samples nothing here: the pipeline fits each reference to a megapixel, ten seconds a sample
    return chain.runs(module_tmp("edit_plus"), MODEL, both, per_run={"ddp_resumed": ["samples=none"]})


def test_references_pair_by_number_and_an_image_with_too_many_or_none_is_skipped(references: Path) -> None:
    from ds_trainer.train import data

    cfg = checks.check(make_cfg(f"model={MODEL}", "data=folder", f"data.path={references / 'images'}",
                                f"data.control_path={references / 'references'}", "resolution.width=64",
                                "resolution.height=64")).cfg
    images = data.SourceImages(cfg)
    assert images.names() == ["a.png", "b.png"]
    assert images.skipped == {f"no reference image (in {references / 'references'})": 1,
                              f"4 reference images (in {references / 'references'}), model.references=3": 1}
    a, b = images[0], images[1]
    assert a.control is not None and len(a.more) == 1 and a.more[0].shape == a.pixels.shape == (3, 64, 64)
    assert a.control[2, 32, 32] > 0.5 and a.more[0][1, 32, 32] > 0.3  # a_0 blue in its middle, a_1 green
    assert b.control is not None and b.more == () and b.control[0, 32, 32] > 0.5
    # one reference count a batch: the layout groups a (2) and b (1) apart
    assert images.layout is not None and images.layout.references == [2, 1]
    assert set(images.layout.counts()) == {"64x64, 2 references", "64x64, 1 references"}
    # a table names them in a column of lists
    rows = [{"file_name": "images/a.png", "text": "make it red", "control": ["references/a_0.png",
                                                                             "references/a_1.jpg"]},
            {"file_name": "images/b.png", "text": "make it red", "control": "references/b_0000.png"}]
    (references / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    entry = f"{{path: {references / 'metadata.jsonl'}, control_column: control}}"
    table = data.SourceImages(checks.check(make_cfg(f"model={MODEL}", "data=sources", f"data.sources=[{entry}]")).cfg)
    assert [len(item.more_controls) for item in table.items] == [1, 0]


@pytest.mark.parametrize(("model", "change", "key", "says", "fix"), [
    (MODEL, ["model.references=4"], "model.references", "takes 1 to 3 reference image(s)", "model.references=3"),
    ("flux_kontext_tiny", ["model.references=2"], "model.references", "takes 1 to 1", "model.references=1"),
    ("qwen_image_tiny", ["model.references=2"], "model.references", "reads no reference images",
     "model.references=1"),
    (MODEL, ["model.references=2", "samples=on", "samples.images=[a.png+b.png+c.png]"], "samples.images",
     "3 reference images for one prompt; model.references=2", "at most 2 joined by '+'"),
])
def test_what_cannot_hold_several_references_is_refused_with_the_fix(model: str, change: list[str], key: str,
                                                                    says: str, fix: str) -> None:
    report = checks.check(make_cfg(f"model={model}", *change))
    shown = report.render()
    assert not report.ok and key in shown and says in shown and fix in shown, shown


def test_captions_are_the_plus_pipelines_with_each_reference_named_and_the_latents_follow_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The template with `Picture 1:`, `Picture 2:` before the caption and each reference at the pipeline's
    condition size, against QwenImageEditPlusPipeline's own encoding with transformers' Qwen2VLProcessor; the
    transformer sees the image's tokens, then each reference's (img_shapes), and predicts the image's alone."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
    from transformers import ProcessorMixin, Qwen2VLProcessor

    from ds_trainer.train.families import of, qwen_edit_plus

    for size in ((64, 64), (96, 128), (1216, 832)):
        assert qwen_edit_plus.condition_size(*size) == calculate_dimensions(CONDITION_IMAGE_SIZE, size[0] / size[1])
    cfg = make_cfg(f"model={MODEL}")
    family = of(cfg)
    frozen = family.load_frozen(cfg)
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda _self, _name, arg: type(arg))
    real = Qwen2VLProcessor(image_processor=frozen.processor.image_processor, tokenizer=frozen.tokenizer,
                            video_processor=None)
    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=frozen.vae, text_encoder=frozen.text_encoder,
                                     tokenizer=frozen.tokenizer, processor=real, transformer=None)
    assert (qwen_edit_plus.TEMPLATE, qwen_edit_plus.DROP) == (pipe.prompt_template_encode,
                                                             pipe.prompt_template_encode_start_idx)
    refs = torch.rand(1, 2, 3, 64, 96) * 2 - 1
    prompt = ["turn the small blue circle into a green cube at night"]
    ours = family.text_inputs(frozen, prompt, torch.device("cpu"), refs)
    theirs, mask = pipe._get_qwen_prompt_embeds(prompt, qwen_edit_plus.pictures(refs), torch.device("cpu"))
    length = theirs.shape[1]
    assert int(ours["prompt_mask"].sum()) == length < ours["prompt_mask"].shape[1]
    assert torch.equal(ours["prompt_mask"][:, :length], mask)
    torch.testing.assert_close(ours["prompt_embeds"][:, :length], theirs, rtol=0, atol=1e-6)
    latents, refs_latents = torch.randn(1, 4, 4, 6), [torch.randn(1, 4, 6, 4), torch.randn(1, 4, 4, 4)]
    seen: dict[str, Any] = {}
    model = family.load_trained(cfg)
    model.register_forward_hook(lambda _m, _args, kwargs, out: seen.update(kwargs, out=out), with_kwargs=True)
    batch = {"latents": latents, "control_latents": refs_latents[0], "control_latents_1": refs_latents[1], **ours}
    losses = family.losses(model, family.schedule(cfg), batch, torch.randn_like(latents), torch.tensor([500]),
                           torch.device("cpu"), torch.float32)
    assert losses.shape == (1,) and seen["img_shapes"] == [[(1, 2, 3), (1, 3, 2), (1, 2, 2)]]
    assert seen["hidden_states"].shape == (1, 6 + 6 + 4, 16) and family.lora_pipeline() is QwenImageEditPlusPipeline


@pytest.mark.slow
def test_samples_of_different_reference_counts_train_in_batches_of_one_count(references: Path,
                                                                             tmp_path: Path) -> None:
    result = run_cli(f"model={MODEL}", "data=folder", f"data.path={references / 'images'}",
                     f"data.control_path={references / 'references'}", "logger=none", "train.max_steps=2",
                     "train.micro_batch_size=2", "data.bucket_remainder=repeat", "resolution.width=64",
                     "resolution.height=64", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    log = (run_dir / "ds_trainer.log").read_text()
    assert "bucket 64x64, 1 references: 1 image(s)" in log and "bucket 64x64, 2 references: 1 image(s)" in log
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"


# --- the chain


@pytest.mark.slow
@pytest.mark.multiproc
def test_trains_under_zero3_on_two_ranks_and_samples_from_two_references_what_the_exported_pipeline_makes(
        runs: Callable[[str], Path], references: Path) -> None:
    from ds_trainer.train.data import cache as latent_cache

    run_dir = runs("zero3_x2")
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    vals = chain.validation(run_dir)
    assert sorted(vals) == [4, 8] and vals[8] < vals[4]
    cached = [latent_cache.read(folder) for folder in (run_dir.parents[2] / "cache").glob(f"{MODEL}-*")]
    item = cached[0]["00000000"]  # synthetic pairs: three references each, every one's latents cached
    assert {k for k in item if k.startswith("control_latents")} == {"control_latents", "control_latents_1",
                                                                    "control_latents_2"}
    index = json.loads((run_dir / "pipeline" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and index["processor"][1] == "Qwen2VLProcessor"
    exported = chain.weights(run_dir / "transformer")
    assert numerics.mean_abs_difference(exported, chain.weights(run_dir / "pipeline" / "transformer")) == 0
    both = Path(f"{references / 'samples' / 'first.png'}+{references / 'samples' / 'second.png'}")
    chain.assert_sample_is_the_pipelines(run_dir, bf16=True, max_sequence_length=32, reference=both)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", chain.RESUMED)
def test_a_zero3_checkpoint_resumes_under_ddp_and_fsdp_within_noise(runs: Callable[[str], Path],
                                                                   layout: str) -> None:
    chain.assert_resumed_within_noise(runs("zero3_x2"), runs(layout))


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_lora_trained_under_fsdp_loads_into_the_plus_pipeline_and_changes_its_transformer(
        runs: Callable[[str], Path]) -> None:
    from diffusers import QwenImageEditPlusPipeline
    from safetensors.torch import load_file

    run_dir = runs("lora_fsdp_x2")
    assert sorted(chain.losses(run_dir)) == list(range(1, 9))
    assert set(load_file(run_dir / "lora" / "kohya.safetensors")) and all(
        k.startswith("transformer.") for k in load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors"))
    pipe = pipelines.load(run_dir / "pipeline")
    assert type(pipe) is QwenImageEditPlusPipeline
    gen = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 12, 16, generator=gen), "timestep": torch.tensor([0.5]),
              "encoder_hidden_states": torch.randn(1, 5, 32, generator=gen),
              "encoder_hidden_states_mask": torch.ones(1, 5, dtype=torch.long),
              "img_shapes": [[(1, 2, 2), (1, 2, 2), (1, 2, 2)]]}
    with torch.no_grad():
        base = pipe.transformer(**inputs).sample
        pipe.load_lora_weights(run_dir / "lora")
        adapted = pipe.transformer(**inputs).sample
    assert (adapted - base).abs().max() > 1e-4  # every adapted module found its tensors, and they change it
