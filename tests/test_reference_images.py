"""An editing model's reference images (`model.reference_images`: Flux.1 Kontext, `model=flux_kontext_tiny`, and
Qwen-Image-Edit, `model=qwen_image_edit_tiny`): paired by name from a folder (`data.control_path`: the same relative
path and name, any extension) or a table's column (`control_column`), fitted and cut as their image is, skipped with
the image (and said) when missing, cached as latents beside the image's (Qwen-Image-Edit's captions encoded with
them); a run from a folder trains, validates and samples; what cannot hold them is refused with the fix. The chains
of ZeRO-3, DDP and FSDP2 runs with the exported FluxKontextPipeline's and QwenImageEditPipeline's images are
test_transformers'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from PIL import Image

from ds_trainer.config import checks

torch = pytest.importorskip("torch")


def _picture(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, (240, 240, 240))
    image.paste(colour, (size[0] // 4, size[1] // 4, size[0] * 3 // 4, size[1] * 3 // 4))
    image.save(path)
    return path


@pytest.fixture
def pairs(tmp_path: Path) -> Path:
    """images/a.png, b.png, sub/c.jpg with captions; references/a.png, sub/c.png (another extension, another size);
    b has none."""
    for name in ("a.png", "b.png", "sub/c.jpg"):
        _picture(tmp_path / "images" / name, (128, 128), (220, 40, 40))
        (tmp_path / "images" / name).with_suffix(".txt").write_text("make the square red")
    _picture(tmp_path / "references" / "a.png", (128, 128), (40, 80, 220))
    _picture(tmp_path / "references" / "sub" / "c.png", (96, 160), (40, 180, 60))
    return tmp_path


def test_references_pair_by_name_and_an_image_without_one_is_skipped(pairs: Path) -> None:
    from ds_trainer.train import data

    cfg = checks.check(make_cfg("model=flux_kontext_tiny", "data=folder", f"data.path={pairs / 'images'}",
                                f"data.control_path={pairs / 'references'}")).cfg
    images = data.SourceImages(cfg)
    assert images.names() == ["a.png", "sub/c.jpg"]
    assert images.skipped == {f"no reference image (in {pairs / 'references'})": 1}
    first, second = images[0], images[1]
    assert first.control is not None and first.control.shape == first.pixels.shape == (3, 128, 128)
    # a's reference is blue in its middle, c's green, each fitted to the image's 128 x 128
    assert first.control[2, 64, 64] > 0.5 and first.control[0, 64, 64] < 0
    assert second.control is not None and second.control[1, 64, 64] > 0.3 and second.control.shape == (3, 128, 128)
    # A table names them in a column (paths relative to the table)
    rows = [{"file_name": "images/a.png", "text": "make it red", "control": "references/a.png"},
            {"file_name": "images/b.png", "text": "make it red", "control": "references/none.png"}]
    (pairs / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    entry = f"{{path: {pairs / 'metadata.jsonl'}, control_column: control}}"
    cfg = checks.check(make_cfg("model=flux_kontext_tiny", "data=sources", f"data.sources=[{entry}]")).cfg
    table = data.SourceImages(cfg)
    assert [n.split("/", 1)[1] for n in table.names()] == ["images/a.png"] and sum(table.skipped.values()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux_kontext_tiny", "qwen_image_edit_tiny"])
def test_an_editing_model_trains_validates_and_samples_from_a_folder_of_pairs(pairs: Path, model: str) -> None:
    from ds_trainer.train.data import cache as latent_cache

    result = run_cli(f"model={model}", "data=folder", f"data.path={pairs / 'images'}",
                     f"data.control_path={pairs / 'references'}", "logger=none", "train.max_steps=3",
                     "validation=on", "validation.split=1", "samples=on", "samples.steps=2",
                     "samples.prompts=[make the square red]", f"samples.images=[{pairs / 'references' / 'a.png'}]",
                     cwd=pairs, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(pairs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary.get("val_loss") is not None
    assert list((run_dir / "samples").glob("step_*/*.png"))
    cached = [latent_cache.read(folder) for folder in (pairs / "outputs" / "cache").glob(f"{model}-*")]
    assert cached and all(item["control_latents"].shape == item["latents"].shape for c in cached for item in c.values())
    if model == "qwen_image_edit_tiny":  # each caption's sequence holds its reference's 25 vision tokens, 2 and 32
        assert {tuple(item["prompt_embeds"].shape) for c in cached for item in c.values()} == {(59, 32)}
        # no empty prompt is cached: a dropped caption would be each image's own (refused below)
        assert not list((pairs / "outputs" / "cache").glob(f"{model}-*/empty*"))


@pytest.mark.parametrize(("change", "says", "fix"), [
    (["data=folder", "data.path=/tmp"], "each image needs its own", "data.control_path=/path/to/references"),
    (["samples=on", "samples.prompts=[a]"], "each sample prompt needs one", "samples.images=[/path/to/reference.png]"),
    (["validation=on", "validation.path=/tmp"], "no reference images paired", "validation.split=0.05"),
    (["model=sd3_tiny", "model.reference_images=true"], "has no reference-image input", "model=flux_kontext_dev"),
    (["model=qwen_image_edit_tiny", "data.caption_dropout=0.1"], "encodes each caption with its reference image",
     "data.caption_dropout=0"),
    (["model=qwen_image_edit_tiny", "data=folder", "data.path=/tmp", "data.control_path=/tmp", "data.tag_shuffle=true"],
     "tags shuffled or dropped", "data.tag_shuffle=false"),
    (["model=qwen_image_edit_tiny", "data.text_encoder_dropout.qwen_vl=0.2"], "has this one encoder alone",
     "fix: data.text_encoder_dropout.qwen_vl=0"),
    (["model=flux_tiny", "samples=on", "samples.prompts=[a]", "samples.images=[/tmp/x.png]"],
     "samples from its prompts alone", "samples.images=[]"),
])
def test_what_cannot_hold_reference_images_is_refused_with_the_fix(change: list[str], says: str, fix: str) -> None:
    report = checks.check(make_cfg("model=flux_kontext_tiny", *change))
    shown = report.render()
    assert not report.ok and says in shown and fix in shown, shown
    # no fix sends Qwen-Image-Edit's user to a caption dropout it refuses
    assert "caption_dropout" not in shown or any("caption_dropout" in c for c in change), shown


def test_an_editing_models_card_names_its_base_and_the_image_to_image_task() -> None:
    """The model card's front matter of a Kontext or Qwen-Image-Edit fine-tune: the makers' base model and license,
    tagged image-to-image (as their own cards are); a text-to-image model's card keeps its tag."""
    from ds_trainer.train.export import card

    for model, _family, base, license_ in (("flux_kontext_dev", "flux", "black-forest-labs/FLUX.1-Kontext-dev",
                                           "license_name: flux-1-dev-non-commercial-license"),
                                          ("qwen_image_edit", "qwen_image", "Qwen/Qwen-Image-Edit",
                                           "license: apache-2.0")):
        text = card._front_matter(make_cfg(f"model={model}"), lora=True)
        assert f"base_model: {base}" in text and license_ in text, text
        assert "- image-to-image" in text and "text-to-image" not in text, text
    assert "- text-to-image" in card._front_matter(make_cfg("model=qwen_image"), lora=False)
