"""Every input surface (ds_trainer/config/surfaces.py) over the corpus of damaged files
(tests/helpers/damaged.py): each case ends skipped and counted (a sample) or refused on one screen
naming the file (a whole file), never in a traceback. A surface added to the list without cases
here fails the first test."""

from __future__ import annotations

import io
import itertools
import json
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import damaged
from helpers import sources as src
from helpers.cfg import make_cfg
from helpers.cli import run_cli
from test_sources import _dataset

from ds_trainer.config import checks, portability, surfaces, trust
from ds_trainer.config.problems import ConfigError
from ds_trainer.errors import DataError, TrainingError

torch = pytest.importorskip("torch")


def _safetensors(tensors: dict[str, tuple[int, ...]]) -> bytes:
    from safetensors.torch import save

    return save({key: torch.zeros(shape) for key, shape in tensors.items()})


VAE = {"encoder.conv_in.weight": (4, 3, 3, 3), "decoder.conv_out.weight": (3, 4, 3, 3)}
SDXL = {"model.diffusion_model.input_blocks.0.0.weight": (4, 4),
        "model.diffusion_model.label_emb.0.0.weight": (4, 4),
        "conditioner.embedders.0.transformer.text_model.embeddings.position_ids": (1, 4),
        "conditioner.embedders.1.model.ln_final.weight": (4,), "first_stage_model.decoder.conv_in.weight": (4,)}
LORA = {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight": (4, 8),
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight": (8, 4)}


def _refused(key: str, path: Path, *args: str) -> None:
    """The configuration's checks refuse it on one screen: the key, the file, why and the fix."""
    report = checks.check(make_cfg(*args))
    text = report.render()
    assert not report.ok and f"  - {key}=" in text and str(path) in text, text
    assert "why:" in text and "fix:" in text, text


def _weights(key: str, name: str, others: dict[str, dict[str, tuple[int, ...]]], *args: str,
             good: dict[str, tuple[int, ...]] | None = None) -> Callable[[Path], int]:
    """A weights file given as `key`: every damaged form, and the files of other models (`others`)."""
    def run(tmp_path: Path) -> int:
        path, n = tmp_path / name, 0
        for _ in damaged.cases(path, _safetensors(good or {"w": (64, 64)})):
            _refused(key, path, f"{key}={path}", *args)
            n += 1
        for tensors in others.values():
            path.write_bytes(_safetensors(tensors))
            _refused(key, path, f"{key}={path}", *args)
            n += 1
        return n
    return run


def _pretrained_folder(tmp_path: Path) -> int:
    folder, n = tmp_path / "pipeline", 0
    folder.mkdir()
    contents = {"empty": {}, "a component only": {"unet/config.json": "{}"},
                "its index cut short": {"model_index.json": '{"unet": ["diff'},
                "its index a list": {"model_index.json": "[1, 2]"},
                "a part missing": {"model_index.json": json.dumps({"unet": ["diffusers", "U"],
                                                                   "vae": ["diffusers", "A"]}),
                                   "unet/config.json": "{}"}}
    for files in contents.values():
        for child in sorted(folder.rglob("*"), reverse=True):
            child.unlink() if child.is_file() else child.rmdir()
        for rel, text in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)
        _refused("model.pretrained", folder, f"model.pretrained={folder}")
        n += 1
    return n


def _cache_dir(tmp_path: Path) -> int:
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("x")
    _refused("data.cache_dir", in_the_way, f"data.cache_dir={in_the_way / 'cache'}")
    return 1  # a read-only disk is the same check (os.access); root writes through mode bits


def _marker(folder: Path, step: int = 2) -> dict[str, Any]:
    from ds_trainer.train.state import checkpoint

    return trust.signed({"step": step, "layout": {}, **checkpoint.record_files(folder)})


def _resume(tmp_path: Path) -> int:
    """The checkpoint folder: its marker in every damaged form, then a file cut after it was written."""
    from ds_trainer.train.state import checkpoint

    folder, n = tmp_path / "run" / "checkpoints" / "step_00000002", 0
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(_safetensors({"w": (64, 64)}))
    good = json.dumps(_marker(folder)).encode()
    cfg = make_cfg(f"resume={folder}")
    for _ in damaged.cases(folder / "COMPLETE", good):
        with pytest.raises(ConfigError) as refused:
            checkpoint.find_resume(cfg, tmp_path / "new")
        assert f"resume={folder}" in str(refused.value) and "COMPLETE" in str(refused.value)
        n += 1
    (folder / "COMPLETE").write_bytes(good)
    assert checkpoint.find_resume(cfg, tmp_path / "new") == folder
    (folder / "model.safetensors").write_bytes(_safetensors({"w": (64, 64)})[:-10])
    with pytest.raises(ConfigError, match="model.safetensors is .* bytes"):
        checkpoint.find_resume(cfg, tmp_path / "new")
    return n + 1


def _portable(tmp_path: Path) -> int:
    """The portable state a checkpoint from elsewhere resumes through: its record, shards, schedule, EMA."""
    from ds_trainer.train.state import portable

    folder, n = tmp_path / "step_00000002", 0
    (folder / "portable").mkdir(parents=True)
    (folder / "COMPLETE").write_text(json.dumps(_marker(folder)))
    cfg = checks.check(make_cfg("zero=stage2", f"resume={folder}")).cfg
    meta = folder / "portable" / "meta.json"
    for case in itertools.chain(damaged.cases(meta, b'{"step": 2, "layout": {}}'), ["schema"]):
        if case == "schema":  # each case as it is made; then a whole JSON file whose keys are missing
            damaged._clear(meta)
            meta.write_text('{"step": 2, "layout": {}}')
        problems, _ = portability.check(cfg, folder)
        assert len(problems) == 1, case
        assert problems[0].key == "resume" and "meta.json" in problems[0].why, problems
        n += 1
    shard = folder / "portable" / "state-00001.safetensors"
    for _ in damaged.cases(shard, _safetensors({"fp32/w": (64, 64)})):
        with pytest.raises(TrainingError, match="state-00001.safetensors cannot be read"):
            portable.Reader(folder, {"index": {"fp32/w": shard.name}}).get("fp32/w")
        n += 1
    good = (tmp_path / "good.pt")
    torch.save({"last_batch_iteration": 1}, good)
    for name, what in (("scheduler.pt", "LR schedule"), ("ema.pt", "EMA")):
        for _ in damaged.cases(folder / name, good.read_bytes()):
            with pytest.raises(TrainingError, match=f"{name} (is not the|holds a)"):
                portable.saved_state(folder / name, what)
            n += 1
    return n


def _whole_or_rows(root: Path, path: Path, entries: list[dict[str, object]], rows: int) -> str:
    """A table or shard after damage: refused naming it, its damaged rows skipped and counted, or (the
    damage missed what is read) read whole."""
    report = checks.check(make_cfg("data=sources", src.override(entries), f"paths.outputs={root / 'out'}",
                                   "data.max_bad_fraction=1"))
    if not report.ok:  # no file there at all (a folder, a symlink loop): the configuration's checks
        assert str(path) in report.render(), report.render()
        return "refused"
    try:
        _, data = _dataset(root, entries)
    except DataError as exc:
        assert str(path) in str(exc), exc
        return "refused"
    index = len(entries) - 1
    skipped = sum(n for (source, _), n in data.skipped_by_source.items() if source == index)
    if data.found[index] + skipped < rows or skipped:
        assert skipped, data.skipped_by_source
        return "skipped"
    return "read"


def _tables(tmp_path: Path) -> int:
    folder, n = src.make("folder", tmp_path / "folder", n=2), 0
    for kind in ("jsonl", "csv", "parquet"):
        path = Path(src.make(kind, tmp_path / kind, n=3))
        good = path.read_bytes()
        for case in damaged.cases(path, good):
            outcome = _whole_or_rows(tmp_path / f"{kind}-{n}", path, [{"path": folder}, {"path": str(path)}], 3)
            assert outcome != "read" or case in ("cut one byte short", "a header that lies"), (kind, case)
            n += 1
        path.write_bytes(good)
    return n


def _saved_dataset(tmp_path: Path) -> int:
    """Each file of a dataset saved with save_to_disk (its split's .arrow, its JSON files) in every
    damaged form: the dataset refused naming its folder (pyarrow's OSError escaped for three)."""
    folder, n = src.make("folder", tmp_path / "folder", n=2), 0
    saved = Path(src.make("hf", tmp_path / "saved", n=3))
    for file in sorted(p for p in saved.rglob("*") if p.is_file()):
        good = file.read_bytes()
        for case in damaged.cases(file, good):
            outcome = _whole_or_rows(tmp_path / f"s{n}", saved, [{"path": folder}, {"path": str(saved)}], 3)
            assert outcome == "refused", (file.name, case)
            n += 1
        damaged._clear(file)
        file.write_bytes(good)
    return n


def _rows(tmp_path: Path) -> int:
    """A table's damaged rows: skipped, counted and named (test_sources checks their reasons too)."""
    table = Path(src.make("jsonl", tmp_path / "rows", n=3))
    lines = table.read_text().splitlines()
    broken = {"cut": lines[1][:-5], "an array": "[1, 2]", "a number": "7", "no file name": '{"text": "x"}',
              "a file name of another type": '{"file_name": 3, "text": "x"}'}
    table.write_text("\n".join([lines[0], *broken.values(), lines[2]]) + "\n")
    _, data = _dataset(tmp_path, [{"path": str(table)}])
    assert sum(data.skipped_by_source.values()) == len(broken) and data.found[0] == 2 + len(broken)
    assert len([k for names in data.skipped_names.values() for k in names]) == len(broken)
    return len(broken)


def _shards(tmp_path: Path) -> int:
    folder, n = src.make("folder", tmp_path / "folder", n=2), 0
    src.make("webdataset", tmp_path / "web", n=3)
    shard = sorted((tmp_path / "web").glob("*.tar"))[0]
    good = shard.read_bytes()
    with tarfile.open(shard) as tar:
        rows = len({m.name.split(".")[0] for m in tar if m.name.endswith(".png")})
    with tarfile.open(shard) as tar:
        boundary = [m.offset for m in tar][-1]
    for case in itertools.chain(damaged.cases(shard, good), ["cut at a member's boundary"]):
        if case == "cut at a member's boundary":
            damaged._clear(shard)
            shard.write_bytes(good[:boundary])
        outcome = _whole_or_rows(tmp_path / f"w{n}", shard, [{"path": folder}, {"path": str(shard)}], rows)
        assert outcome != "read" or case in ("cut one byte short",), case
        n += 1
    with tarfile.open(shard, "w") as tar:  # a member that is no image: skipped and counted
        for name, data in (("a.png", b"not a png"), ("a.txt", b"a caption"), ("b.png", src.png(3))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert _whole_or_rows(tmp_path / "member", shard, [{"path": folder}, {"path": str(shard)}], 2) == "skipped"
    return n + 1


def _images(tmp_path: Path) -> int:
    """An image of a folder in every damaged form, and a legal one above data.max_image_pixels."""
    folder, n = Path(src.make("folder", tmp_path / "folder", n=2)), 0
    image = folder / "img_bad.png"
    (folder / "img_bad.txt").write_text("a caption")
    variants = [*damaged.forms(src.png(5)).items(), ("huge", damaged.huge_png())]
    for case, content in variants:
        image.write_bytes(content)
        _, data = _dataset(tmp_path / f"i{n}", [{"path": str(folder)}])
        reasons = [reason for (_, reason), names in data.skipped_names.items() if "img_bad" in names[0]]
        expected = len(content) > 0 and case in ("cut one byte short", "a header that lies")
        assert len(reasons) == 1 or expected, (case, data.skipped_by_source)
        if case == "huge":
            assert reasons == ["too large (100000x100000, above data.max_image_pixels=178956970)"]
        n += 1
    image.unlink()
    for case, make in damaged.places(image).items():
        make()
        _, data = _dataset(tmp_path / f"p{n}", [{"path": str(folder)}])
        assert data.unique == 2, (case, data.skipped_by_source)  # not an image file: not listed, or skipped
        damaged._clear(image)
        n += 1
    return n


def _videos(tmp_path: Path) -> int:
    """A video model's clip in every damaged form, an audio file named as a clip, and a legal clip whose frames are
    above data.max_image_pixels: each is skipped and counted with its reason (or, cut where the frames before the
    cut still decode, trains on those: a webm's frames stream in order), the rest trains."""
    from test_video import write_clips

    folder, n = write_clips(tmp_path / "folder"), 0
    (folder / "torn.mp4").unlink()
    clip, good = folder / "bad.webm", (folder / "spin.webm").read_bytes()
    (folder / "bad.txt").write_text("a caption")
    wan = ["model=wan_tiny", "data.video.frames=[1,5]"]
    for case in damaged.cases(clip, good):
        _, data = _dataset(tmp_path / f"v{n}", [{"path": str(folder)}], *wan)
        reasons = [reason for (_, reason), names in data.skipped_names.items() if "bad.webm" in names[0]]
        usable = "folder/bad.webm" in data.names()
        assert (len(reasons) == 1) != usable or case in damaged.places(clip), (case, data.skipped_by_source)
        assert data.unique >= 5, (case, data.skipped_by_source)  # the other clips and the image train
        n += 1
    audio = folder / "voice.mp4"
    _audio(audio)
    _, data = _dataset(tmp_path / "audio", [{"path": str(folder)}], *wan)
    assert data.skipped_names[(0, "no video stream (an audio file?)")] == ["folder/voice.mp4"]
    audio.unlink()
    _, data = _dataset(tmp_path / "large", [{"path": str(folder)}], *wan, "data.max_image_pixels=5000")
    assert data.skipped_names[(0, "too large (96x64 a frame, above data.max_image_pixels=5000)")] == [
        "folder/walk.mp4"]
    # a low limit skips the data's large files, not Pillow's opening of others (a sample, 128 x 128)
    from PIL import Image

    picture = tmp_path / "sample.png"
    Image.new("RGB", (128, 128)).save(picture)
    with Image.open(picture) as image:
        image.load()
    return n + 2


def _audio(path: Path) -> None:
    """An mp4 holding an AAC sound and no picture."""
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)


def _captions(tmp_path: Path) -> int:
    """A caption in every damaged form: read as what it holds (any bytes decode as Latin-1, said), or
    where no file can be read, the image trains with an empty caption and the log says why."""
    folder, n = Path(src.make("folder", tmp_path / "folder", n=2)), 0
    caption = folder / "img000.txt"
    for case in damaged.cases(caption, caption.read_bytes()):
        _, data = _dataset(tmp_path / f"c{n}", [{"path": str(folder)}])
        assert data.unique == 2 and isinstance(data.caption(0), str), case
        n += 1
    return n


def _attached(tmp_path: Path, part: str) -> int:
    """A file an image trains with (its mask, its reference image) in every damaged form: the image is
    skipped and counted, the file named in its reason (it was read, and failed, mid-training); where no
    file is there (a folder, a symlink loop in its place) the image trains without it (unmasked) or is
    skipped as having none (a reference)."""
    from ds_trainer.train import data

    folder, n = Path(src.make("folder", tmp_path / "folder", n=3)), 0
    if part == "mask":
        attached, overrides = folder / "img000.mask.png", ["data.masked_loss=true"]
        label = "its mask (.mask.png): "
    else:
        (tmp_path / "refs").mkdir()
        for image in folder.glob("*.png"):
            (tmp_path / "refs" / image.name).write_bytes(image.read_bytes())
        attached = tmp_path / "refs" / "img000.png"
        overrides = ["model=flux_kontext_tiny", f"data.control_path={tmp_path / 'refs'}"]
        label = "its reference image: "
    good = src.png(7)
    for case in damaged.cases(attached, good):
        cfg = checks.check(make_cfg("data=folder", f"data.path={folder}",
                                    f"data.cache_dir={tmp_path / f'c{n}'}", "data.max_bad_fraction=0.5",
                                    *overrides)).cfg
        images = data.SourceImages(cfg)
        reasons = [r for (_, r), names in images.skipped_names.items() if "img000" in names[0]]
        if case in ("a folder", "a symlink loop"):
            assert images.unique == (3 if part == "mask" else 2), (case, reasons)
        elif case not in ("cut one byte short", "a header that lies"):  # still decodes: trains
            assert len(reasons) == 1 and reasons[0].startswith(label) and images.unique == 2, (case, reasons)
        n += 1
    return n


def _cache_packs(tmp_path: Path) -> int:
    """A pack of the latent cache in every damaged form (a shared cache_dir, a copy cut short): left out
    of the cache's index with a warning, so its samples are encoded again (a new pack of the same names
    replaces it); a whole pack is read back."""
    import torch

    from ds_trainer.train import families
    from ds_trainer.train.data import cache as latent_cache
    from ds_trainer.train.data import images

    cfg = make_cfg(f"data.cache_dir={tmp_path / 'cache'}", "data.num_samples=3")
    data = images.dataset(cfg)
    cache = latent_cache.LatentCache(cfg, data, families.of(cfg), "cpu")
    cache.dir.mkdir(parents=True)
    pack = latent_cache._Pack(cache.dir, 8)
    for name in cache.names:
        pack.add(name, {"latents": torch.ones(4, 8, 8), "prompt_embeds": torch.zeros(7, 16)})
    pack.write()
    (path,) = cache.packs()
    good, n = path.read_bytes(), 0
    for case in itertools.chain(damaged.cases(path, good), ["whole"]):  # each case as it is made
        if case == "whole":
            damaged._clear(path)
            path.write_bytes(good)
        cache._index = None
        index = cache._scan()
        if case == "whole":
            assert sorted(index) == sorted(cache.names)
            assert torch.equal(cache._read(cache.names[0], index, None)["latents"], torch.ones(4, 8, 8))
        else:
            assert index == {}, case  # none of its samples is read from it: they are encoded again
        n += 1
    return n


def _presets(tmp_path: Path) -> int:
    """An experiment preset in every damaged form: refused naming its file before Hydra reads it, or,
    where the damage left a whole preset (a last newline cut, the header line alone), composed."""
    from ds_trainer.config import overrides

    preset = tmp_path / "outputs" / "presets" / "experiment" / "mine.yaml"
    preset.parent.mkdir(parents=True)
    good = b"# @package _global_\ntrain:\n  max_steps: 3\n"
    argv, n = ["+experiment=mine", f"paths.outputs={tmp_path / 'outputs'}"], 0
    saved, sys.argv = sys.argv, ["ds_trainer", *argv]  # the command line the checks read, as a run's
    try:
        for case in damaged.cases(preset, good):
            problems = overrides.check_args(argv, False)
            whole = case in ("cut one byte short", "cut at 20 bytes")  # the header alone: an empty preset
            assert (problems == []) if whole else (len(problems) == 1 and str(preset) in problems[0].why), case
            n += 1
    finally:
        sys.argv = saved
    damaged._clear(preset)
    preset.write_bytes(bytes(range(128, 256)))  # the command itself: one screen, exit 2, no traceback
    run = run_cli(*argv, "dry_run=true", cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"its file {preset} is not UTF-8 text" in run.stderr
    return n + 1


RUNNERS: dict[str, Callable[[Path], int]] = {
    "model.pretrained (file)": _weights("model.pretrained", "sdxl.safetensors", {"a VAE": VAE, "a LoRA": LORA}),
    "model.pretrained (folder)": _pretrained_folder,
    "model.vae": _weights("model.vae", "vae.safetensors", {"a LoRA": LORA}),
    "model.transformer": _weights("model.transformer", "sd3.safetensors", {"an SDXL checkpoint": SDXL,
                                                                             "a VAE": VAE}, "model=sd3_tiny"),
    "adapter.init_from": _weights("adapter.init_from", "lora.safetensors", {}, "adapter=lora", good=LORA),
    "resume": _resume,
    "resume (portable state)": _portable,
    "data.cache_dir": _cache_dir,
    "table": _tables,
    "table row": _rows,
    "tar shard": _shards,
    "saved dataset": _saved_dataset,
    "image": _images,
    "video": _videos,
    "caption": _captions,
    "preset": _presets,
    "cache pack": _cache_packs,
    "mask": lambda tmp_path: _attached(tmp_path, "mask"),
    "reference image": lambda tmp_path: _attached(tmp_path, "control"),
}


def test_every_input_surface_has_its_damaged_cases() -> None:
    assert set(RUNNERS) == surfaces.NAMES


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_a_damaged_file_is_skipped_and_counted_or_refused_naming_it(name: str, tmp_path: Path) -> None:
    assert RUNNERS[name](tmp_path) >= 1
