"""The model families' facts, torch-free: one `FamilySpec` record per family (its module in this
folder) and the registry that finds one by name or by the class of a trained module.

Everything before a run (the config checks, the planner, `convert`, the sweep report) and the parts
of a run that only need facts (the model card, a file's header, the export's choice of parts) ask
the spec, never the family's name. What needs torch (encoding, the loss, the pipeline, the makers'
key layouts) is the family's own module, `spec.implementation` (train/families/). Adding a family:
its spec module here and a line in `SPECS`, its implementation under train/families/, its
`conf/model/` options and `assets/` folders."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ds_trainer.config.families import chroma, flux, flux2, qwen_image, sd3, sdxl, wan, z_image
from ds_trainer.config.families.spec import FamilySpec, TransformerFile

__all__ = [
    "NAMES",
    "SPECS",
    "FamilySpec",
    "TransformerFile",
    "of",
    "of_classes",
    "spec",
    "with_flow",
]


# The registry: a family is found here by name (model.family) or by its trained module's class.
SPECS: dict[str, FamilySpec] = {
    s.name: s
    for s in (sdxl.SPEC, sd3.SPEC, flux.SPEC, qwen_image.SPEC, wan.SPEC, chroma.SPEC, z_image.SPEC,
              flux2.SPEC)
}
NAMES: tuple[str, ...] = tuple(SPECS)


def spec(name: object) -> FamilySpec:
    """The spec of `model.family` (an enum or its name)."""
    return SPECS[str(getattr(name, "value", name))]


def of(cfg: Any) -> FamilySpec:
    """The spec of a composed config's model (SDXL where the model names none, as the schema's
    default)."""
    model = cfg.get("model") if hasattr(cfg, "get") else cfg.model
    return spec((model or {}).get("family") or "sdxl")


def of_classes(names: Iterable[str]) -> FamilySpec:
    """The spec whose trained module is one of these class names (a module's classes, its MRO);
    SDXL's otherwise."""
    names = set(names)
    return next((s for s in SPECS.values() if names & set(s.module_classes)), SPECS["sdxl"])


def with_flow() -> list[FamilySpec]:
    """The families trained by flow matching, in the registry's order (for messages that list them).
    """
    return [s for s in SPECS.values() if s.flow]
