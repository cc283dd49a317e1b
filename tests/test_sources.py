"""Datasets as people keep them (issue 47): several sources of every kind (a folder, metadata.jsonl, CSV, parquet of
image bytes, webdataset tar shards, a saved Hugging Face dataset) weighed by repeats, caption dropout drawn from the
seed and the sample's position, each source reported, bad sources refused on one screen."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from helpers import sources as src
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.ranks import torchrun

from ds_trainer.config import checks
from ds_trainer.errors import DataError

torch = pytest.importorskip("torch")


def _all_kinds(root: Path, n: int = 3, repeats: dict[str, int] | None = None) -> list[dict[str, object]]:
    return [{"path": src.make(kind, root / kind, n=n, first=10 * i), **({"repeats": repeats[kind]}
                                                                      if repeats and kind in repeats else {})}
            for i, kind in enumerate(src.KINDS)]


def _dataset(root: Path, entries: list[dict[str, object]], *overrides: str):  # noqa: ANN202 - SourceImages
    from ds_trainer.train import data

    # The damaged files these tests plant are a large share of their tiny sources: data.max_bad_fraction's stop
    # is tested on its own (test_a_source_mostly_damaged_stops_the_run).
    report = checks.check(make_cfg("data=sources", src.override(entries), f"paths.outputs={root / 'out'}",
                                   "data.max_bad_fraction=1", *overrides))
    assert report.ok, report.render()
    return report.cfg, data.dataset(report.cfg)


def test_every_kind_of_source_is_read_with_its_captions_and_repeats(tmp_path: Path) -> None:
    entries = _all_kinds(tmp_path, repeats={"folder": 2, "hf": 3})
    # A damaged image in the folder and in a shard: skipped, counted under their source with the reason.
    (tmp_path / "folder" / "broken.png").write_bytes(src.png(99)[:60])
    with tarfile.open(tmp_path / "webdataset" / "shard-001.tar", "a") as tar:
        info = tarfile.TarInfo("sample9999.png")
        info.size = 0
        tar.addfile(info)
    _, data = _dataset(tmp_path, entries)
    assert data.unique == 3 * len(src.KINDS) and len(data) == 3 * (len(src.KINDS) - 2) + 3 * 2 + 3 * 3
    by_source: dict[str, set[str]] = {}
    for index, key in enumerate(data.names()):
        source = data.sources[data.source_of(index)]
        by_source.setdefault(source.kind, set()).add(data.caption(index))
        assert key.startswith(f"{source.name}/")
    kinds = {"folder": "folder", "table": None, "webdataset": "webdataset", "hf": "hf"}
    assert by_source["folder"] == {src.caption("folder", i) for i in range(3)}
    assert by_source["webdataset"] == {src.caption("webdataset", i) for i in range(3)}
    assert by_source["hf"] == {src.caption("hf", i) for i in range(3)}
    assert by_source["table"] == {src.caption(k, i) for k in ("jsonl", "csv", "parquet") for i in range(3)}
    assert set(kinds) == set(by_source)
    assert data.skipped_by_source == {(0, "truncated or corrupt image"): 1, (4, "empty file"): 1}
    assert [s.name for s in data.sources] == list(src.KINDS)  # a file or shards named by their folder
    pixels = {tuple(data[i].pixels[:, 0, 0].tolist()) for i in range(len(data))}
    assert len(pixels) == data.unique  # every image distinct, each read from its own bytes


def test_two_sources_with_repeats_1_and_3_are_seen_1_to_3_and_captions_drop_at_their_rate(tmp_path: Path) -> None:
    from ds_trainer.train.data import loader

    entries = [{"path": src.make("folder", tmp_path / "a", n=8), "name": "one"},
               {"path": src.make("parquet", tmp_path / "b", n=8, first=50), "name": "three", "repeats": 3,
                "caption_dropout": 0.5}]
    cfg, data = _dataset(tmp_path, entries, "data.caption_dropout=0.2", "train.micro_batch_size=2")
    policy = loader.policy_of(cfg, data)
    one, three = loader.seen(data, 0, 8000, policy, {"clip_g": 0.3})
    assert one["samples_seen"] + three["samples_seen"] == 8000
    assert abs(three["samples_seen"] / one["samples_seen"] - 3.0) < 0.1, (one, three)
    assert abs(one["captions_dropped"] / one["samples_seen"] - 0.2) < 0.02
    assert abs(three["captions_dropped"] / three["samples_seen"] - 0.5) < 0.02
    assert abs((one["encoders_dropped"]["clip_g"] + three["encoders_dropped"]["clip_g"]) / 8000 - 0.3) < 0.02
    # Every epoch (32 samples: 8 + 3 x 8) sees each image of `one` once and of `three` three times.
    one, three = loader.seen(data, 0, 32 * 5, policy)
    assert (one["samples_seen"], three["samples_seen"]) == (8 * 5, 24 * 5)


def test_a_parquet_files_images_are_read_when_used_not_held_in_memory(tmp_path: Path) -> None:
    import gc
    import random
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ds_trainer.train.data import readers, sources

    noisy = [random.Random(i).randbytes(40_000) for i in range(48)]  # 1.9 MB of image bytes, 6 row groups
    pngs = [src.png(i) + blob for i, blob in enumerate(noisy)]  # trailing bytes: still a PNG to PIL, and large
    table = tmp_path / "big.parquet"
    pq.write_table(pa.table({"image": [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(pngs)],
                             "caption": [f"image {i}" for i in range(48)]}), table, row_group_size=8)
    (source,) = sources.of(make_cfg("data=sources", f"data.sources=[{{path: '{table}'}}]"))
    gc.collect()
    before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        items = readers.items(source)
        gc.collect()  # what is held, not garbage awaiting a collection
        held = tracemalloc.get_traced_memory()[0]  # Python's objects the listing keeps (bytes, rows)
    finally:
        tracemalloc.stop()
    total = sum(map(len, pngs))
    # pyarrow's threaded reads left 4 groups' worth allocated after a first listing (CI, and here with more threads)
    assert held < total / 4 and pa.total_allocated_bytes() - before < total / 4  # listed without keeping the bytes
    assert [item.caption for item in items] == [f"image {i}" for i in range(48)]
    for i in (0, 7, 8, 47, 3):  # across row groups, and back
        with items[i].read() as f:
            assert f.read() == pngs[i], i
    assert items[5].stat[0] == len(pngs[5])


def test_a_fractional_repeat_weighs_a_source_down_over_an_epoch_of_whole_passes(tmp_path: Path) -> None:
    from ds_trainer.train.data import loader

    entries = [{"path": src.make("folder", tmp_path / "a", n=8), "name": "whole"},
               {"path": src.make("parquet", tmp_path / "b", n=8, first=50), "name": "half", "repeats": 0.5}]
    cfg, data = _dataset(tmp_path, entries, "train.micro_batch_size=2")
    assert data.passes == 2 and len(data) == 8 * 2 + 8  # an epoch: two passes, the half source's images once
    whole, half = loader.seen(data, 0, 24 * 5, loader.policy_of(cfg, data))
    assert (whole["samples_seen"], half["samples_seen"]) == (80, 40) and half["repeats"] == 0.5


def test_damaged_files_of_every_kind_are_skipped_and_named_or_refused_naming_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The damaged forms of each file a source is made of (issue 62): captions in the encodings Windows tools write
    read as written and said once per source; a table's damaged rows skipped, counted and named; a table, parquet
    file or tar shard that is empty, cut short or not that format at all refused naming it (DataError: the
    one-screen refusal), never a traceback."""
    import logging

    caplog.set_level(logging.WARNING, logger="ds_trainer")
    words = "café, naïve façade — 20°"
    folder = Path(src.make("folder", tmp_path / "folder", n=4))
    for i, encoding in enumerate(("utf-8-sig", "utf-16", "cp1252")):
        (folder / f"img{i:03d}.txt").write_bytes(f"{words} {i}".encode(encoding))
    table = Path(src.make("jsonl", tmp_path / "jsonl", n=4))
    lines = table.read_text().splitlines()
    table.write_text("\n".join([lines[0], lines[1][:-5], "[1, 2]", *lines[3:]]) + "\n")  # a cut line, an array
    csv_table = Path(src.make("csv", tmp_path / "csv", n=3))
    plain = words.replace(",", "")  # a field of the table's own, unquoted
    csv_table.write_bytes(csv_table.read_text().replace("csv picture number 0", plain).encode("cp1252"))
    _, data = _dataset(tmp_path, [{"path": str(folder)}, {"path": str(table)}, {"path": str(csv_table)}])
    captions = {data.caption(i) for i in range(len(data))}
    assert {f"{words} {i}" for i in range(3)} | {f"a {plain}"} <= captions, captions
    assert "read 1 text file(s) as cp1252, 1 text file(s) as utf-16, 1 text file(s) as utf-8-sig" in caplog.text
    damaged = {why: n for (index, why), n in data.skipped_by_source.items() if index == 1}
    assert damaged == {"damaged row in metadata.jsonl (not JSON: Unterminated string starting at, column 41)": 1,
                       "damaged row in metadata.jsonl (a JSON list, not an object)": 1}, data.skipped_by_source
    assert sorted(k for (index, _), keys in data.skipped_names.items() if index == 1 for k in keys) == [
        "jsonl/line00000002", "jsonl/line00000003"]
    assert "jsonl/line00000002" in caplog.text and data.unique == 4 + 2 + 3
    # Whole files that cannot be read: each refused naming it
    shards = Path(src.make("webdataset", tmp_path / "web", n=4)).parent
    whole = (shards / "shard-000.tar").read_bytes()
    parquet = Path(src.make("parquet", tmp_path / "pq", n=2))
    cases = {"cut tar": (shards / "cut.tar", whole[: len(whole) // 2]), "cut tar header": (shards / "head.tar",
             whole[:700]), "not a tar": (shards / "text.tar", b"hello, not a tar file\n" * 40),
             "empty tar": (shards / "empty.tar", b""), "cut parquet": (tmp_path / "pq" / "cut.parquet",
             parquet.read_bytes()[:300]), "empty table": (tmp_path / "jsonl" / "empty.jsonl", b""),
             "only damaged rows": (tmp_path / "jsonl" / "bad.jsonl", b"{not json\n[1]\n")}
    for case, (path, content) in cases.items():
        path.write_bytes(content)
        with pytest.raises(DataError) as refused:
            _dataset(tmp_path / case.replace(" ", "_"), [{"path": str(folder)}, {"path": str(path)}])
        assert str(path) in str(refused.value), (case, refused.value)


@pytest.mark.parametrize(("change", "expected"), [
    ({"path": "/nowhere/images"}, ["data.sources[1].path=/nowhere/images", "does not exist"]),
    ({"path": "SHARDS/shard-{000..002}.tar"}, ["shard-002.tar", "does not exist"]),
    ({"repeats": 0}, ["data.sources[1].repeats=0", "above 0"]),
    ({"repeats": 0.37}, ["data.sources[1].repeats=0.37", "denominator up to 20", "repeats=0.368"]),
    ({"caption_dropout": 1.5}, ["data.sources[1].caption_dropout=1.5", "probability"]),
    ({"tag_dropout": -0.1}, ["data.sources[1].tag_dropout=-0.1", "probability"]),
    ({"resolution": 20}, ["data.sources[1].resolution=20", "no bucket of about 20x20"]),
])
def test_a_bad_source_is_refused_before_anything_loads(tmp_path: Path, change: dict[str, object],
                                                       expected: list[str]) -> None:
    shards = src.make("webdataset", tmp_path / "w", n=4)
    entry = {"path": shards, **{k: str(v).replace("SHARDS", str(tmp_path / "w")) if k == "path" else v
                                for k, v in change.items()}}
    report = checks.check(make_cfg("data=sources", src.override([{"path": src.make("folder", tmp_path / "f")}, entry])))
    text = report.render()
    assert not report.ok and all(e in text for e in expected), text


def test_a_sources_own_resolution_needs_buckets_and_sets_its_buckets_area(tmp_path: Path) -> None:
    entries = [{"path": src.make("folder", tmp_path / "big", n=3)},
               {"path": src.make("csv", tmp_path / "small", n=3), "resolution": 64}]
    refused = checks.check(make_cfg("data=sources", src.override(entries), "data.buckets=false"))
    assert "data.sources[1].resolution=64" in refused.render() and "data.buckets=true" in refused.render()
    cfg, dataset = _dataset(tmp_path, entries)
    areas = {dataset.sources[dataset.source_of(i)].name: dataset.layout.bucket(i) for i in range(len(dataset))}
    assert areas == {"big": (128, 128), "small": (64, 64)}
    from ds_trainer.config import buckets as geometry

    width, height = geometry.largest(checks.check(make_cfg("data=sources", src.override(
        [entries[0], {**entries[1], "resolution": 256}]))).cfg)
    assert width * height == 256 * 256  # a source larger than the run's resolution bounds memory (the planner's)


def test_a_source_whose_contents_do_not_fit_is_one_screen_naming_it(tmp_path: Path) -> None:
    table = Path(src.make("csv", tmp_path / "c"))
    for entry, expected in (
            ({"path": str(table), "caption_column": "prompt"},
             ["caption_column=prompt", "its columns: file_name, text"]),
            ({"path": str(table), "image_column": "picture"}, ["image_column=picture"]),
            ({"path": src.make("hf", tmp_path / "h"), "split": "validation"}, ["no split 'validation'", "train"]),
            ({"path": str((tmp_path / "empty").mkdir() or tmp_path / "empty")},
             ["data.sources[0] (empty)=", "no jpg/png/webp files; nothing to train on"])):
        with pytest.raises(DataError) as error:
            _dataset(tmp_path, [entry])
        assert all(e in str(error.value) for e in expected), str(error.value)
    # As a user runs it: exit 2, the source named, no traceback.
    done = run_cli("data=sources", src.override([{"path": str(table), "caption_column": "prompt"}]), "logger=none",
                   cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "data.sources[0] (c)" in done.stderr and "caption_column=prompt" in done.stderr
    wrong = checks.check(make_cfg("data=folder", f"data.path={tmp_path}", src.override([{"path": str(table)}])))
    assert "is read with data=sources only" in wrong.render()


@pytest.fixture(scope="module")
def sourced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs from every kind of source: 6 steps on one rank with a checkpoint at step 3, and the same run resumed
    from that checkpoint on two ranks under ZeRO-2 (micro batch 1 instead of 2: the same global batch)."""
    root = tmp_path_factory.mktemp("sources")
    entries = _all_kinds(root, repeats={"folder": 3})
    entries[-1].update(regularization=True, loss_weight=0.5)  # the saved dataset: regularisation images
    entries[0].update(tag_shuffle=True, keep_tokens=1, tag_dropout=0.3)  # the folder's tag captions
    entries[2].update(resolution=64)  # the CSV's images at 64x64 beside the others' 128x128
    args = ["data=sources", src.override(entries), "data.caption_dropout=0.3", "data.masked_loss=true",
            "data.text_encoder_dropout.clip_g=0.3",
            "data.unmasked_weight=0.25", "logger=none", "train.max_steps=6",
            "train.checkpoint_every=3", "scheduler=constant", "train.micro_batch_size=2"]
    (root / "one").mkdir()
    # The cache built ahead on two ranks (`python -m ds_trainer.cache`) in packs of 4 samples (each rank's 9 images:
    # 4, 4 and 1), then one pack lost as a kill in the middle of a build leaves it: the training run (packs of 256)
    # encodes those four alone.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ahead = subprocess.run([*torchrun(2), "-m", "ds_trainer.cache", *args, "zero=ddp", "data.cache_pack=4",
                            f"hydra.run.dir={root / 'cache-run'}"],
                           cwd=root / "one", capture_output=True, text=True, timeout=900, env=env)
    assert ahead.returncode == 0, ahead.stderr[-3000:]
    (folder,) = (root / "one" / "outputs" / "cache").glob("sdxl_tiny-buckets-*")
    packs = {path: _names_in(path) for path in folder.glob("pack-*.safetensors")}
    assert sorted(map(len, packs.values())) == [1, 1, 4, 4, 4, 4], packs
    for lost in [next(path for path, names in packs.items() if len(names) == 4), *folder.glob("manifest-*.json")]:
        lost.unlink()
    done = run_cli(*args, "zero=ddp", cwd=root / "one", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (first,) = run_dirs(root / "one")
    (root / "two").mkdir()
    resumed = subprocess.run(
        [*torchrun(2), "-m", "ds_trainer", *args, "zero=stage2", "train.micro_batch_size=1",
         "train.gradient_accumulation_steps=1", f"resume={first / 'checkpoints' / 'step_00000003'}",
         f"data.cache_dir={root / 'one' / 'outputs' / 'cache'}"],
        cwd=root / "two", capture_output=True, text=True, timeout=900, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (second,) = run_dirs(root / "two")
    return {"root": root, "one": first, "two": second, "cache": root / "cache-run"}


def test_a_run_trains_from_every_kind_and_reports_each_source(sourced: dict[str, Path]) -> None:
    summary = json.loads((sourced["one"] / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 6
    rows = [json.loads(line) for line in (sourced["one"] / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < row["loss"] < 10 for row in rows if "loss" in row)
    reported = {s["name"]: s for s in summary["sources"]}
    assert list(reported) == list(src.KINDS)
    assert reported["folder"]["repeats"] == 3 and reported["folder"]["images"] == 3
    assert {s["kind"] for s in summary["sources"]} == {"folder", "table", "webdataset", "hf"}
    assert sum(s["samples_seen"] for s in summary["sources"]) == 6 * 2  # 6 steps of a global batch of 2
    assert 0 < sum(s["captions_dropped"] for s in summary["sources"]) < 12
    assert summary["images"] == 3 * len(src.KINDS) + 2 * 3  # the folder's images three times an epoch
    card = (sourced["one"] / "README.md").read_text()
    assert "`webdataset` (webdataset): 3 images x 1 an epoch" in card
    log = (sourced["one"] / "ds_trainer.log").read_text()
    assert "data.sources[4] (webdataset)=" in log and "3 image(s), repeated 1 time(s) an epoch" in log
    assert "cached latents and embeddings of 24 samples (18 images)" in log  # a repeated image is cached once
    # the build's kill cost the pack in flight; the training run's four went to a pack of their own
    assert "4 image(s) encoded now on 1 rank(s), 14 there from an earlier build; 6 pack(s)" in log
    assert "data.sources[0] (folder): tags shuffled at ',', the first 1 kept in place, each other dropped with 0.3" \
        in log and "captions whose tags vary are encoded batch by batch" in log
    assert "text encoder dropout: clip_g 0.3" in log
    assert reported["folder"]["tags"] == {"shuffle": True, "keep_tokens": 1, "dropout": 0.3}
    assert reported["csv"]["resolution"] == 64 and "resolution" not in reported["folder"]
    assert "in buckets of about 64x64 pixels" in log and summary["buckets"]["64x64"] == 3  # the CSV's three alone
    assert "tags" not in reported["csv"]  # a source without a tag policy of its own keeps data's (none)
    assert 0 < sum(s["encoders_dropped"]["clip_g"] for s in summary["sources"]) < 12


def test_the_cache_built_ahead_on_two_ranks_is_the_one_training_reads(sourced: dict[str, Path]) -> None:
    summary = json.loads((sourced["cache"] / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 0 and summary["world_size"] == 2
    assert summary["cache"]["samples"] == 24 and summary["cache"]["files"] == 18 and summary["host_rss_peak_mib"] > 0
    assert summary["cache"]["packs"] == 6  # each rank's 9 images in packs of 4 (data.cache_pack=4)
    log = (sourced["cache"] / "ds_trainer.log").read_text()
    assert "18 image(s) encoded now on 2 rank(s), 0 there from an earlier build; 6 pack(s)" in log
    assert "cache_only: the latent cache of 24 samples is complete" in log
    assert not (sourced["cache"] / "checkpoints").exists()  # nothing trained


def test_a_resume_on_two_ranks_continues_the_same_samples_captions_and_tags(sourced: dict[str, Path]) -> None:
    one = json.loads((sourced["one"] / "summary.json").read_text())
    two = json.loads((sourced["two"] / "summary.json").read_text())
    assert two["status"] == "ok" and two["world_size"] == 2 and two["steps"] == 6
    assert two["sources"] == one["sources"]  # samples seen and captions dropped per source, resume included
    # Steps 4-6 trained the same samples with the same captions dropped, the same tags shuffled and dropped and the same
    # encoder parts zeroed: the losses agree across the layouts.
    losses = [{row["step"]: row["loss"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "loss" in row} for run in (sourced["one"], sourced["two"])]
    for step in (4, 5, 6):
        assert abs(losses[0][step] - losses[1][step]) < 1e-3 * max(1.0, losses[0][step]), (step, losses)
    log = (sourced["two"] / "ds_trainer.log").read_text()
    assert "cached latents" not in log  # the one-rank run's cache serves the two ranks


def _names_in(pack: Path) -> set[str]:
    """The samples a cache pack holds (its tensors are keyed `<name>/<key>`)."""
    import safetensors

    with safetensors.safe_open(str(pack), framework="pt") as f:
        return {key.rpartition("/")[0] for key in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def _cache(sourced: dict[str, Path], *overrides: str, cache_dir: Path | None = None,
           ) -> tuple[object, object, object, object]:
    """The first run's configuration, data, family and latent cache, as that run built them (or in `cache_dir`)."""
    from ds_trainer.train import data, families

    root = sourced["root"]
    cfg = checks.check(make_cfg("data=sources", src.override(_entries_of(sourced["one"])), "data.masked_loss=true",
                                "train.micro_batch_size=2",
                                f"data.cache_dir={cache_dir or root / 'one' / 'outputs' / 'cache'}", *overrides)).cfg
    dataset = data.dataset(cfg)
    family = families.of(cfg)
    return cfg, dataset, family, data.LatentCache(cfg, dataset, family, "cpu")


def test_a_dropped_caption_trains_with_the_empty_prompts_cached_encoding(sourced: dict[str, Path]) -> None:
    cfg, dataset, family, cache = _cache(sourced)
    assert cache.complete  # the run's own cache: same key, every image there
    batch = cache.load([0, 1], [True, False])
    alone = cache.load([0, 1])
    frozen = family.load_frozen(cfg, contextlib.nullcontext)
    with torch.no_grad():
        empty = family.text_inputs(frozen, [""], torch.device("cpu"))
        own = family.text_inputs(frozen, [dataset.caption(0)], torch.device("cpu"))
    for key in empty:
        assert torch.allclose(batch[key][0], empty[key][0].float(), atol=1e-5), key
        assert torch.equal(batch[key][1], alone[key][1]) and torch.allclose(alone[key][0], own[key][0], atol=1e-5)
    assert torch.equal(batch["latents"], alone["latents"])  # the image is the same; only its caption is dropped


def test_a_cache_of_one_file_per_image_an_earlier_version_wrote_is_read_as_the_packs_are(sourced: dict[str, Path],
                                                                                          tmp_path: Path) -> None:
    import shutil

    from ds_trainer.train.data import cache as latent_cache

    _, dataset, _, cache = _cache(sourced)
    old = tmp_path / "cache" / cache.dir.name  # type: ignore[attr-defined]
    shutil.copytree(cache.dir, old)  # type: ignore[attr-defined]
    items = latent_cache.read(old)
    assert len(items) == 18  # every image once, in the packs of two runs (the build ahead and the training run's)
    for pack in old.glob("pack-*.safetensors"):  # the layout before packs: <bucket>/<name>.pt each
        pack.unlink()
    for name, item in items.items():
        (old / name).parent.mkdir(parents=True, exist_ok=True)
        torch.save(item, old / f"{name}.pt")
    _, _, _, earlier = _cache(sourced, cache_dir=tmp_path / "cache")
    assert earlier.complete and earlier.files() == 18 and len(earlier.packs()) == 18  # type: ignore[attr-defined]
    for i in range(len(dataset)):  # type: ignore[arg-type]
        got, expected = earlier.load([i], [i % 3 == 0]), cache.load([i], [i % 3 == 0])  # type: ignore[attr-defined]
        assert got.keys() == expected.keys() and all(torch.equal(got[key], expected[key]) for key in got), i


def test_tags_shuffle_behind_the_kept_ones_and_drop_at_their_rate_the_same_way_every_time() -> None:
    from ds_trainer.train.data import captions

    caption = "sks dog, red collar, grass, sunny, park, 35mm"
    tags = [t.strip() for t in caption.split(",")]
    policy = captions.Policy(shuffle=True, keep_tokens=1, tag_dropout=0.25)
    drawn = [captions.text(caption, policy, 7, position) for position in range(2000)]
    assert drawn == [captions.text(caption, policy, 7, position) for position in range(2000)]  # a function of both
    assert all(text.split(", ")[0] == "sks dog" for text in drawn)  # the trigger word stays first
    assert all(set(text.split(", ")) <= set(tags) for text in drawn)
    kept = sum(len(text.split(", ")) - 1 for text in drawn) / (len(drawn) * (len(tags) - 1))
    assert abs(kept - 0.75) < 0.02, kept
    whole = [t for t in drawn if len(t.split(", ")) == len(tags)]
    assert len({tuple(t.split(", ")[1:]) for t in whole}) > 20  # shuffled: many orders of the same tags
    assert captions.text(caption, captions.Policy(), 7, 3) == caption  # no policy: the caption as written


def test_varying_captions_are_encoded_per_batch_and_an_encoders_part_is_zeroed(sourced: dict[str, Path]) -> None:
    import types

    from ds_trainer.train import data
    from ds_trainer.train.backends.mesh import Mesh

    cfg, dataset, family, cache = _cache(sourced, "data.text_encoder_dropout.clip_g=0.5")
    frozen = family.load_frozen(cfg, contextlib.nullcontext)
    device = torch.device("cpu")
    ranks = types.SimpleNamespace(process_index=0, num_processes=1, device=device, is_main_process=True)
    run = types.SimpleNamespace(cfg=cfg, accelerator=ranks, frozen=frozen, family=family,
                                mesh=Mesh.of(cfg, ranks))
    loader = data.Loader(run, dataset, cache)  # type: ignore[arg-type]
    width = frozen.text_encoder.config.hidden_size
    shuffled = zeroed = 0
    try:
        for b in range(12):
            batch, position = loader(b), loader.position(b)
            indices = dataset.plan.samples(position, 2)
            cached = cache.load(indices)
            for j, index in enumerate(indices):
                source = dataset.sources[dataset.source_of(index)]
                dropped = data.captions.dropped(cfg.train.seed, position + j, source.caption_dropout)
                text = "" if dropped else data.captions.text(dataset.caption(index), source.captions, cfg.train.seed,
                                                              position + j)
                with torch.no_grad():
                    own = family.text_inputs(frozen, [text], device)
                gone = data.captions.dropped(cfg.train.seed, position + j, 0.5, "clip_g")
                embeds = batch["prompt_embeds"][j]
                assert torch.allclose(embeds[:, :width], own["prompt_embeds"][0, :, :width], atol=1e-5)  # CLIP-L's
                if gone:  # bigG's part (and its pooled projection) zeros, as a pipeline without it
                    assert not embeds[:, width:].any() and not batch["pooled"][j].any()
                else:
                    assert torch.allclose(embeds[:, width:], own["prompt_embeds"][0, :, width:], atol=1e-5)
                zeroed += gone
                if source.captions.varies and not dropped and text != dataset.caption(index):
                    shuffled += 1  # trained with other tags than the cache holds
                    assert not torch.allclose(cached["prompt_embeds"][j, :, :width], embeds[:, :width])
    finally:
        loader.close()
    assert shuffled and 0 < zeroed < 24, (shuffled, zeroed)


def test_sd3s_text_parts_are_where_each_encoder_writes() -> None:
    from ds_trainer.train import families

    cfg = checks.check(make_cfg("model=sd3_tiny", "data.text_encoder_dropout.t5=0.5")).cfg
    family = families.of(cfg)
    frozen = family.load_frozen(cfg, contextlib.nullcontext)
    with torch.no_grad():
        both = family.text_inputs(frozen, ["a red square", "a blue bar"], torch.device("cpu"))
        t5 = frozen.text_encoder_3(frozen.tokenizer_3(["a red square"], padding="max_length", truncation=True,
                                                      max_length=int(cfg.model.flow.t5_max_length),
                                                      return_tensors="pt").input_ids)[0]
    parts = family.text_parts(frozen)
    assert set(parts) == {"clip_l", "clip_g", "t5"}
    ((key, where),) = parts["t5"]
    assert torch.allclose(both[key][0][where], t5[0].to(both[key].dtype), atol=1e-5)  # T5's sequence, whole
    covered = torch.zeros_like(both["prompt_embeds"][0], dtype=torch.bool)
    pooled = torch.zeros_like(both["pooled"][0], dtype=torch.bool)
    for name in parts:
        for key, where in parts[name]:
            (covered if key == "prompt_embeds" else pooled)[where] = True
    assert pooled.all()  # every pooled feature is some encoder's
    assert covered.any(dim=-1).all()  # every token row is some encoder's


def test_a_masked_loss_is_the_mean_of_the_errors_weighed_by_the_mask(sourced: dict[str, Path]) -> None:
    from ds_trainer.train import data

    cfg, dataset, family, cache = _cache(sourced)
    names = dataset.names()
    alpha, file, none = (names.index(f"folder/img00{i}.png") for i in range(3))
    batch = cache.load([alpha, file, none])
    mask = batch["mask"][:, 0]
    assert mask.shape[-2:] == batch["latents"].shape[-2:]  # at the latents' resolution
    assert mask[0, :, 0].min() > 0.99 and mask[0, :, -1].max() < 0.01  # the alpha channel's left half
    assert mask[1, 0, :].min() > 0.99 and mask[1, -1, :].max() < 0.01  # the .mask.png's top half
    assert mask[2].min() == 1.0  # no mask: all of it
    model, schedule = family.load_trained(cfg).eval(), family.schedule(cfg)
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(batch["latents"].shape, generator=generator)
    t = torch.tensor([10, 500, 900])
    weight = 0.25 + 0.75 * batch["mask"]
    with torch.no_grad():
        got = family.losses(model, schedule, {**batch, "weight_map": weight}, noise, t, torch.device("cpu"),
                            torch.float32)
        plain = family.losses(model, schedule, batch, noise, t, torch.device("cpu"), torch.float32)
        noisy = schedule.add_noise(batch["latents"], noise, t)
        pred = model(noisy, t, batch["prompt_embeds"], added_cond_kwargs={"text_embeds": batch["pooled"],
                                                                          "time_ids": batch["time_ids"]}).sample
    assert schedule.config.prediction_type == "epsilon"
    expected = ((pred - noise) ** 2 * weight).mean(dim=(1, 2, 3))
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7), (got, expected)
    assert torch.allclose(got[2], plain[2]) and (got[:2] < plain[:2]).all()  # no mask: the plain loss
    # The validation loss stays unmasked: the held-out images carry no mask.
    held = data.validation_set(checks.check(make_cfg(
        "data=sources", src.override(_entries_of(sourced["one"])), "data.masked_loss=true", "validation=on",
        "validation.split=2", f"paths.outputs={sourced['root'] / 'held'}")).cfg)
    assert all(held[i].mask is None for i in range(len(held)))


def _entries_of(run_dir: Path) -> list[dict[str, object]]:
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    keys = ("path", "repeats", "regularization", "loss_weight", "tag_shuffle", "keep_tokens", "tag_dropout",
            "resolution")
    return [{key: s[key] for key in keys if s[key] is not None} for s in config["data"]["sources"]]


def test_regularisation_images_weigh_their_loss_and_are_reported_apart(sourced: dict[str, Path]) -> None:
    _, dataset, _, _ = _cache(sourced)
    rows = [json.loads(line) for line in (sourced["one"] / "metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if "loss" in row}
    kinds = set()
    for step, row in steps.items():
        drawn = dataset.plan.samples(2 * (step - 1), 2)  # the step's two samples
        regular = [dataset.sources[dataset.source_of(i)].regularization for i in drawn]
        kinds.add(sum(regular))
        if not any(regular):  # no regularisation image in the step: nothing reported apart
            assert "loss_regularization" not in row and "loss_images" not in row
        elif all(regular):  # only regularisation images: the loss is theirs at loss_weight 0.5
            assert abs(row["loss"] - 0.5 * row["loss_regularization"]) < 1e-5 * row["loss"], row
        else:  # one of each: the mean of the image's loss and half the regularisation image's
            expected = (row["loss_images"] + 0.5 * row["loss_regularization"]) / 2
            assert abs(row["loss"] - expected) < 1e-5 * row["loss"], row
    assert kinds - {0}, "no step drew a regularisation image: the check saw nothing"
    summary = json.loads((sourced["one"] / "summary.json").read_text())
    reported = {s["name"]: s for s in summary["sources"]}
    assert reported["hf"]["regularization"] is True and reported["hf"]["loss_weight"] == 0.5
    assert "regularization" not in reported["folder"]


def test_the_sweep_report_says_what_each_source_gave_a_cell(sourced: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from ds_trainer.launch import report

    for n, run in enumerate((sourced["one"], sourced["two"])):  # two cells of a sweep, as Hydra lays them out
        (tmp_path / str(n)).mkdir()
        for name in ("summary.json", "config.yaml"):
            shutil.copy(run / name, tmp_path / str(n) / name)
    table = report.rows(tmp_path)
    summary = json.loads((sourced["one"] / "summary.json").read_text())
    seen = {s["name"]: s for s in summary["sources"]}
    text = report.markdown(table)
    assert "samples per source" in text and "hf (regularisation)" in text
    assert f"folder {seen['folder']['samples_seen']}" in table[0]["sources"]
    assert table[0]["sources"] == table[1]["sources"]  # the resumed cell trained the same samples


@pytest.mark.long  # CI budget (a Slurm job of its own): the cache command's own path runs on two ranks by default
@pytest.mark.multiproc
def test_the_cache_is_built_ahead_as_a_slurm_job_and_training_reads_it(tmp_path: Path,
                                                                      slurm_cluster: dict[str, str]) -> None:
    folder = src.make("folder", tmp_path / "images", n=6)
    args = ["data=folder", f"data.path={folder}", "logger=none", "data.cache_pack=2"]
    job = run_cli("-m", "hydra/launcher=slurm_localtest", *args, cwd=tmp_path, env=slurm_cluster, timeout=900,
                  module="ds_trainer.cache")
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    (cell,) = [p.parent for p in (tmp_path / "outputs" / "sweeps").glob("*/*/0/summary.json")]
    summary = json.loads((cell / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["cache"]["complete"]
    assert summary["cache"]["files"] == 6 and summary["cache"]["packs"] == 4  # each task's 3 images: packs of 2, 1
    assert "6 image(s) encoded now on 2 rank(s), 0 there from an earlier build" in (cell / "ds_trainer.log").read_text()
    trained = run_cli(*args, "train.max_steps=1", cwd=tmp_path)  # one local rank, the cache the job built
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "cached latents" not in trained.stderr


def test_the_validation_set_of_a_sources_run_names_its_sources(tmp_path: Path) -> None:
    """validation_set.json and the log said "held out of data.path=None" for a run of data.sources."""
    from ds_trainer.train.observe import validate

    entries = [{"path": src.make("folder", tmp_path / "faces"), "name": "faces"},
               {"path": src.make("jsonl", tmp_path / "style")}]
    cfg = checks.check(make_cfg("data=sources", src.override(entries), "validation=on")).cfg
    assert validate._source(cfg) == "held out of data.sources (faces, style) (validation.split=0.05)"


def test_a_data_mistake_is_refused_before_accelerates_set_up_and_names_the_files(tmp_path: Path) -> None:
    """The data is checked before Accelerate's set-up (and any op build it starts): here a second rank is
    announced that never starts, so the set-up would wait for it until its time limit; the sources' headers
    are read first, and the run is refused in seconds with the skipped files named and summary.json written."""
    from helpers.ranks import free_port

    folder = Path(src.make("jsonl", tmp_path / "table", n=4))
    images = sorted(p for p in folder.parent.rglob("*.png"))
    images[0].write_bytes(b"")
    for image in images[1:]:
        image.write_bytes(b"not a png at all" * 10)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run = run_cli("data=sources", src.override([{"path": str(folder)}]), "logger=none",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=env, timeout=240)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "none readable; nothing to train on" in run.stderr, run.stderr[-3000:]
    assert "not an image (unrecognized format)" in run.stderr and "images/001.png" in run.stderr
    assert "empty file" in run.stderr and "memory plan" not in run.stderr  # before the set-up's first line
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "error" and "none readable" in summary["message"]


def test_a_source_mostly_damaged_stops_the_run(tmp_path: Path) -> None:
    """Above data.max_bad_fraction (5% by default) of a source's files skipped: a copy gone wrong or the wrong
    folder, so one screen naming the source, the share, the commonest reason with examples and the fix."""
    folder = Path(src.make("folder", tmp_path / "f", n=6))
    (folder / "img000.png").write_bytes(b"")
    (folder / "img001.png").write_bytes(src.png(1)[:50])
    with pytest.raises(DataError) as stopped:
        _dataset(tmp_path / "a", [{"path": str(folder)}], "data.max_bad_fraction=0.05")
    text = str(stopped.value)
    assert "2 of its 6 files damaged (33%, above data.max_bad_fraction=0.05)" in text, text
    assert "data.max_bad_fraction=0.38 to train on the rest" in text and "f/img00" in text, text
    _, data = _dataset(tmp_path / "b", [{"path": str(folder)}], "data.max_bad_fraction=0.4")  # the fix works
    assert data.unique == 4
