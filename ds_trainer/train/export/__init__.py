"""The end of a run: the UNet or transformer (and its EMA) and fully trained text encoders in diffusers format (for a
tiny model and a run from a single-file checkpoint a whole pipeline), the single file in the makers' layout
(single_file.py) and the model card (card.py), as `export.formats` asks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import formats, weights_file
from ds_trainer.train.backends import inner
from ds_trainer.train.export import single_file
from ds_trainer.train.families import text_encoders
from ds_trainer.train.state import portable

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")


def diffusers(run: Run) -> None:
    """Collective: under ZeRO-3 every rank takes part in gathering the weights (`get_state_dict`, the fp32
    masters); rank 0 writes `<run>/unet` and `<run>/unet_ema` (a fully trained text encoder also to
    `<run>/text_encoder[_2]` and `..._ema`) and, for a tiny model, `<run>/pipeline`. Parts trained as LoRA are the
    LoRA file's (`adapter.Trained.export`); the pipeline holds their base.

    The weights are exported at their most precise: in 16-bit training DeepSpeed's module holds bf16/fp16 copies and
    the fp32 master weights live in its optimizer, so the trained weights are read from there (as the portable
    state and the LoRA file do); FSDP's and DDP's modules hold the fp32 weights themselves. A bf16 run exported
    from ZeRO and one exported from FSDP so agree to the training's noise, not to bf16's rounding."""
    accelerator = run.accelerator
    state = accelerator.get_state_dict(run.model)
    masters = _masters(run)  # collective
    shadow = run.ema.full(dst=0, device="cpu") if run.ema else None  # collective: the EMA is sharded across the ranks
    if not accelerator.is_main_process:
        return
    with _alone(run):
        _write(run, accelerator.unwrap_model(run.model), {**state, **masters}, shadow)


def _write(run: Run, module: Any, weights: dict[str, torch.Tensor], shadow: dict[str, torch.Tensor] | None) -> None:
    """Each of `export.formats` through its writer (config/formats.py's records), the frozen parts on the CPU loaded
    once for those that need them."""
    exported = _models(module, weights, shadow)
    asked = [WRITERS[name] for name in formats.names(run.cfg.export.formats)]
    frozen = _frozen_on_cpu(run) if any(w.needs_frozen(run, exported) for w in asked) else None
    for writer in asked:
        writer.write(run, exported, frozen)


def _models(module: Any, weights: dict[str, torch.Tensor], shadow: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """The trained parts (the UNet or transformer, fully trained encoders) and their EMA as float32 models on the CPU,
    by their folder's name (`unet`, `unet_ema`, `text_encoder`, ...)."""
    whole = not isinstance(module, text_encoders.Denoiser)
    exported: dict[str, Any] = {}
    for name, part in text_encoders.components(module):
        if text_encoders.is_lora(part):
            continue  # a LoRA: in the LoRA file, on the base the pipeline holds
        trained = weights if whole else text_encoders.split(weights, name)
        averaged = shadow if whole or shadow is None else text_encoders.split(shadow, name)
        for folder, values in ((name, trained), (f"{name}_ema", averaged)):
            if values is None:
                continue
            # The EMA holds the trained parameters: a part the training never moves (CLIP-L's unused last layer)
            # is the trained weights' own.
            model = _fresh(part)
            model.load_state_dict({k: v.float() for k, v in {**trained, **values}.items()})
            exported[folder] = model
    return exported


def _diffusers_files(run: Run, exported: dict[str, Any], frozen: Any) -> None:
    """`<run>/<part>[_ema]` in diffusers' format, and `<run>/pipeline` for a tiny or single-file model."""
    for folder, model in exported.items():
        model.save_pretrained(run.run_dir / folder)
    if _whole_pipeline(run.cfg):
        names = (run.family.component, *_ENCODERS)
        parts = {name: exported.get(f"{name}_ema", exported.get(name)) for name in names}
        _pipeline(run, frozen, **{k: v for k, v in parts.items() if v is not None})


def _single_file_needs_frozen(run: Run, exported: dict[str, Any]) -> bool:
    return run.family.component in exported and bool(run.family.spec.single_file_parts)


def _single_file(run: Run, exported: dict[str, Any], frozen: Any) -> None:
    if run.family.component in exported:
        _single_files(run, exported, frozen)


@dataclass(frozen=True)
class Writer:
    """How one of export.formats is written at a run's end; `needs_frozen`: whether it reads the frozen parts."""

    write: Callable[[Run, dict[str, Any], Any], None]
    needs_frozen: Callable[[Run, dict[str, Any]], bool]


WRITERS = {"diffusers": Writer(_diffusers_files, lambda run, _: _whole_pipeline(run.cfg)),
           "single_file": Writer(_single_file, _single_file_needs_frozen)}


def _single_files(run: Run, exported: dict[str, Any], frozen: Any) -> None:
    """`<run>/single_file/model.safetensors` from the trained weights, `model_ema.safetensors` from the EMA (a fully
    trained encoder's EMA with it); the VAE (SDXL, SD3) and SDXL's encoders as loaded (an encoder trained as LoRA:
    its base, the LoRA file holding its adapters)."""
    component, cfg = run.family.component, run.cfg
    for suffix in ("", "_ema"):
        denoiser = exported.get(component + suffix)
        if denoiser is None:
            continue
        parts = {}
        if frozen is not None:  # what the family's file holds beside the denoiser: a trained encoder as exported
            parts = {p: exported.get(p + suffix, exported.get(p, getattr(frozen, p)))
                     for p in run.family.spec.single_file_parts}
        path = single_file.export(cfg, run.family, run.run_dir, denoiser, parts, ema=bool(suffix))
        log.info("wrote %s (%s, the makers' layout)", path, cfg.export.dtype.value)


_ENCODERS = ("text_encoder", "text_encoder_2")


def _whole_pipeline(cfg: DictConfig) -> bool:
    """A tiny model (random weights nobody else has) and a run from a single-file checkpoint export a whole
    pipeline; a run from a diffusers folder or hub id exports the trained parts, to put into the source's."""
    return bool(cfg.model.about.tiny) or weights_file.is_single_file(cfg.model.pretrained)


def _fresh(part: Any) -> Any:
    """A float32 model of `part`'s class and config, to load exported weights into (on the CPU)."""
    from diffusers import ModelMixin

    if isinstance(part, ModelMixin):  # a UNet, a transformer
        return type(part).from_config(part.config)  # type: ignore[attr-defined]
    model = type(part)(part.config)
    return model.to(torch.float32)


def _masters(run: Run) -> dict[str, torch.Tensor]:
    """Collective: the fp32 masters of the trained parameters where DeepSpeed keeps them apart from a 16-bit
    module (on rank 0; empty elsewhere and where the module's own weights are the masters)."""
    accelerator = run.accelerator
    module = accelerator.unwrap_model(run.model)
    if inner.engine(accelerator) is None or all(p.dtype == torch.float32 for _, p in portable.trainable(module)):
        return {}
    base = inner.optimizer(accelerator, run.optimizer)
    keep = accelerator.is_main_process
    return {name: values[0].detach().to("cpu", torch.float32, copy=True)
            for name, _, values in portable.full_values(run.params, module, base, moments=False)
            if keep and values[0] is not None}


def _pipeline(run: Run, frozen: Any, **trained: Any) -> None:
    """`<run>/pipeline`: the trained parts given (`unet` or `transformer`, `text_encoder`, `text_encoder_2`), the rest
    as loaded (`frozen`, on the CPU; the base of a part trained as LoRA)."""
    pipe = run.family.pipeline(run.cfg, frozen, trained)
    pipe.save_pretrained(run.run_dir / "pipeline")


def _frozen_on_cpu(run: Run) -> Any:
    """The run's frozen parts (VAE, text encoders) on the CPU at their source precision."""
    frozen = run.frozen
    slots = [frozen.vae, *(getattr(frozen, name) for name in (*_ENCODERS, "text_encoder_3") if hasattr(frozen, name))]
    q = run.cfg.quantize
    if any(p is None or p.dtype != torch.float32 for p in slots) or (q.kind.value != "none" and q.text_encoders):
        # Training ran them in 16 bits (a GPU run): up-casting those copies would save rounded weights as
        # float32; or an encoder trained and its base is needed; or they were quantized (quantize=, the text
        # encoders'). They are loaded again, from the source, on the CPU.
        frozen = run.family.load_frozen(run.cfg)
    for part in frozen.modules():
        part.to("cpu")
    return frozen


def base_pipeline(run: Run) -> None:
    """With everything trained as LoRA on a tiny model (random weights nobody else has): the untrained base pipeline on
    rank 0, so that `<run>/lora` can be loaded into it with `load_lora_weights`."""
    if run.cfg.model.about.tiny and run.accelerator.is_main_process:
        with _alone(run):  # the base of a trained encoder is loaded again here
            _pipeline(run, _frozen_on_cpu(run))


@contextmanager
def _alone(run: Run) -> Iterator[None]:
    """Rank 0 building and saving whole models alone: outside ZeRO-3's construction hooks (under a live ZeRO-3 config
    transformers would partition a text encoder as it is built, a collective the other ranks never join), and
    without transformers' "Writing model shards" bar per saved encoder on the terminal."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    with run.backend.whole(run.accelerator):
        yield
