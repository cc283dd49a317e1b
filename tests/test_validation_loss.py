"""The validation set and its rules, without training: which images are held out (never trained, the same
whatever the ranks), the timesteps, and bad settings. The validation loss itself is checked on real runs: its
layout invariance on test_portable's chain, on folder data with buckets under two ranks in test_buckets, its
resume in test_resume_records, the report's column in test_sweeps."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cfg import make_cfg
from test_buckets import IMAGES, make_folder

from ds_trainer.config import checks, holdout
from ds_trainer.errors import DataError

pytest.importorskip("torch")


def _cfg(folder: Path, *overrides: str):  # noqa: ANN202 - DictConfig
    return checks.check(make_cfg("data=folder", f"data.path={folder}", f"paths.outputs={folder.parent / 'out'}",
                                     "validation=on", *overrides)).cfg


@pytest.mark.parametrize("buckets", [True, False])
def test_held_out_images_are_never_in_a_training_batch(tmp_path: Path, buckets: bool) -> None:
    from ds_trainer.train import data

    folder = make_folder(tmp_path / "images")
    cfg = _cfg(folder, "validation.split=2", f"data.buckets={buckets}", "data.bucket_remainder=repeat")
    trained, held = data.dataset(cfg), data.validation_set(cfg)
    assert len(held) == 2 and len(trained) == len(IMAGES) - 2
    assert set(held.names()).isdisjoint(trained.names())
    assert set(held.names()) | set(trained.names()) == {f"{name}.png" for name in IMAGES}
    # Every sample of two epochs of training comes from the trained files.
    n = len(trained)
    if buckets:
        seen = {i for e in (0, 1) for batch in trained.plan.epoch(e) for i in batch}
    else:
        seen = set(data.sample_indices(0, 2 * n, n, int(cfg.train.seed)))
    assert seen == set(range(n))
    # The rule depends on the file names and the split alone: another seed, batch or world size holds out the same.
    other = data.validation_set(_cfg(folder, "validation.split=2", "train.seed=7", "train.micro_batch_size=2",
                                     "world_size=2"))
    assert other.names() == held.names()
    assert holdout.split_files(trained.names() + held.names(), 2)[1] == sorted(held.names())


def test_a_fraction_holds_out_at_least_one_image_and_synthetic_data_gets_images_of_its_own() -> None:
    from ds_trainer.train import data

    assert [holdout.count(0.05, n) for n in (4, 100, 1000)] == [1, 5, 50]
    cfg = checks.check(make_cfg("validation=on", "validation.split=3", "data.num_samples=8")).cfg
    trained, held = data.dataset(cfg), data.validation_set(cfg)
    assert len(trained) == 8 and len(held) == 3
    assert held.names() == ["synthetic #8", "synthetic #9", "synthetic #10"]
    assert held[0].caption == data.SyntheticImages(cfg, 11)[8].caption  # image 8 of the stream, never trained
    assert holdout.timesteps(cfg, 1000) == [125, 375, 625, 875]


def test_a_validation_folder_of_its_own_is_scored_whole_and_the_training_folder_kept_whole(tmp_path: Path) -> None:
    from ds_trainer.train import data

    folder = make_folder(tmp_path / "images")
    other = make_folder(tmp_path / "val", {k: IMAGES[k] for k in ("portrait", "square", "wide")})
    cfg = _cfg(folder, f"validation.path={other}", "validation.split=2")  # the split applies to data.path only
    trained, held = data.dataset(cfg), data.validation_set(cfg)
    assert len(trained) == len(IMAGES)
    assert sorted(held.names()) == ["portrait.png", "square.png", "wide.png"] and held.sources[0].path == str(other)
    assert held[0].caption == "a portrait picture" and held.layout is not None  # each at its bucket's size


def test_bad_validation_data_gets_the_key_the_value_and_the_fix(tmp_path: Path) -> None:
    from ds_trainer.train import data

    folder = make_folder(tmp_path / "images")
    with pytest.raises(DataError, match=r"validation.split=8.*holds out 8 of the 8 usable images.*validation.path="):
        data.dataset(_cfg(folder, "validation.split=8"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"validation.path=.*empty: no jpg/png/webp files; nothing to score"):
        data.validation_set(_cfg(folder, f"validation.path={empty}"))
    report = checks.check(make_cfg("data=folder", f"data.path={folder}", "validation=on",
                                       f"validation.path={folder}", "validation.every=-1", "validation.split=0"))
    text = report.render()
    assert "validation.every=-1" in text and "is the training folder" in text
    assert "validation.split=0" not in text  # with validation.path the split does not apply
    bad_split = checks.check(make_cfg("validation=on", "validation.split=0")).render()
    assert "validation.split=0" in bad_split and "validation.split=0.05, or validation.split=8" in bad_split


def test_the_planner_counts_the_validation_peak_with_the_ema_unet() -> None:
    from ds_trainer.tools import plan

    def peak(*overrides: str) -> int | None:
        cfg = checks.check(make_cfg("train.ema=true", "precision=fp32", *overrides)).cfg  # one forward's shape
        return plan.estimate(cfg, "stage2", "none", 1).sampling

    assert peak() is None  # neither samples nor validation: no evaluation peak
    scored, plain = peak("validation=on"), peak("validation=on", "validation.ema=false")
    unet_params = plan.unet_stats(plan.architecture(make_cfg())).params
    assert scored is not None and plain is not None
    assert scored - plain >= 4 * unet_params  # the EMA scored: a float32 UNet on its shadow
