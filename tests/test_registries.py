"""The registries behind the extension points: each model family's spec (config/families/) builds its
implementation and is found by name and by its trained module's class; each file format (config/formats.py) has
its writer at a run's end. A family or format added to one side only fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cfg import make_cfg

from ds_trainer.config import families, formats

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("option", OPTIONS)
def test_every_model_option_names_a_registered_family_whose_module_is_found_by_its_class(option: str) -> None:
    from ds_trainer.train import families as implementations

    cfg = make_cfg(f"model={option}")
    spec = families.of(cfg)
    family = implementations.of(cfg)
    assert family.spec is spec
    assert family.name == spec.name
    assert family.component == spec.component
    module = family.meta_trained(cfg)
    assert type(module).__name__ in spec.module_classes
    assert implementations.of_module(module).spec is spec
    assert bool(cfg.model.about.tiny) == option.endswith("_tiny")


def test_an_unregistered_module_class_is_sdxl_s_and_the_registry_names_each_family_once() -> None:
    assert families.of_classes(["SomethingElse"]).name == "sdxl"
    classes = [c for s in families.SPECS.values() for c in s.module_classes]
    assert len(classes) == len(set(classes))
    assert set(families.NAMES) == {s.name for s in families.SPECS.values()}


def test_each_format_has_its_writer_and_each_lora_format_says_why_it_cannot_hold_a_method() -> None:
    from ds_trainer.config import schema
    from ds_trainer.train import export
    from ds_trainer.train.adapters import adapter

    assert set(adapter.LORA_WRITERS) == set(formats.LORA)
    assert set(export.WRITERS) == set(formats.MODEL)
    for method in schema.AdapterMethod:
        if method.value == "none":
            continue
        able = formats.for_method(method.value)
        assert able, f"no LoRA format holds {method.value}"
        for record in formats.LORA.values():
            assert method.value in record.methods or record.cannot[method.value]


def test_each_source_kind_has_its_record_and_its_reader() -> None:
    from ds_trainer.config import schema, source_kinds
    from ds_trainer.train.data import readers

    kinds = {k.value for k in schema.SourceKind} - {"auto"}
    assert set(source_kinds.KINDS) == kinds
    assert set(readers.READERS) == kinds
    assert source_kinds.kind_of("/nowhere/shards/{000..009}.tar", "auto") == "webdataset"
    assert source_kinds.paths_of("/nowhere/shards/{000..002}.tar", "auto") == [
        f"/nowhere/shards/00{i}.tar" for i in range(3)]
    assert source_kinds.kind_of("/nowhere/captions.parquet", "auto") == "table"


def test_a_run_written_before_model_about_gets_its_options_facts_for_convert(tmp_path: Path) -> None:
    """`convert --to card` on a run whose config.yaml predates `model.about`: the card still names the base model and
    its license (the model option's facts, as the card tables held them before); a run's own `about` is kept."""
    from omegaconf import OmegaConf

    from ds_trainer.tools import convert
    from ds_trainer.train.export import card

    saved = OmegaConf.to_container(make_cfg("model=flux_dev"), resolve=False)
    del saved["model"]["about"]  # type: ignore[index]
    OmegaConf.save(saved, tmp_path / "config.yaml")
    text = card._front_matter(convert._run_config(tmp_path), lora=True)
    assert "base_model: black-forest-labs/FLUX.1-dev" in text
    assert "license_name: flux-1-dev-non-commercial-license" in text
    saved["model"]["about"] = {"base_id": "someone/their-flux"}  # type: ignore[index]
    OmegaConf.save(saved, tmp_path / "config.yaml")
    assert "base_model: someone/their-flux" in card._front_matter(convert._run_config(tmp_path), lora=True)
