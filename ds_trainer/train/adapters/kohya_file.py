"""The LoRA file in kohya's layout (`<run>/lora/kohya.safetensors`, train/layouts/kohya.py says the names): written
beside diffusers' from the same fp32 masters, with the model spec and kohya's `ss_*` keys in its header; and read
back for `adapter.init_from` (a file of this layout from here, sd-scripts or another trainer that writes it)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch

from ds_trainer.train import families
from ds_trainer.train.adapters import quantize
from ds_trainer.train.adapters.names import is_adapter
from ds_trainer.train.backends import params
from ds_trainer.train.families import text_encoders
from ds_trainer.train.layouts import kohya, lycoris

WEIGHT_NAME = "kohya.safetensors"


def base_shapes(part: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of a LoRA-injected module's own weights, by their names without peft's (`.base_layer`, adapters);
    under ZeRO-3 the full shapes (`ds_shape`); quantize=nf4's as they were before packing (Flux's fused qkv is cut by
    them); quantize=fp8's weights are frozen buffers (adapters/quantize.py)."""
    weights = [*part.named_parameters(), *((n, b) for n, b in part.named_buffers() if quantize.is_float8(b))]
    unpacked = quantize.unpacked_shapes(part)
    return {n.replace(".base_layer", ""): unpacked.get(id(p)) or params.shape(p)
            for n, p in weights if not is_adapter(n)}


def _lora_parts(module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    return ((name, part) for name, part in text_encoders.components(module) if text_encoders.is_lora(part))


def _table(name: str, part: torch.nn.Module) -> tuple[list[Any], dict[str, tuple[int, ...]]]:
    """The layout table of a component (`name`: unet, transformer, text_encoder, ...) and its weights' shapes."""
    shapes = base_shapes(part)
    if name.startswith("text_encoder"):  # transformers' names, in kohya's files too
        return kohya.same_names(shapes), shapes
    return families.of_module(part).kohya_parts(shapes, getattr(part, "config", None)), shapes


def _kind(part: torch.nn.Module) -> str:
    """The adapters' kind in a peft-injected module: lora (DoRA too), lokr or loha."""
    return str(cast(Any, part).peft_config["default"].peft_type.value).lower()


def tensors(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (the LoRA parameters named like `module`'s, fp32) as kohya's tensors, every LoRA component's."""
    from peft.utils import get_peft_model_state_dict

    whole = not isinstance(module, text_encoders.Denoiser)
    out: dict[str, torch.Tensor] = {}
    for name, part in _lora_parts(module):
        mine = weights if whole else text_encoders.split(weights, name)
        if not mine:
            continue
        peft_sd = get_peft_model_state_dict(part, state_dict=mine)
        peft_config: Any = cast(Any, part).peft_config["default"]
        kind = _kind(part)
        if kind in lycoris.KEYS:
            out.update(lycoris.write(name, _table(name, part)[0], kind, peft_sd, int(peft_config.r),
                                     float(peft_config.alpha)))
            continue
        alpha = float(peft_config.lora_alpha)
        adapters = {k.removesuffix(".lora_A.weight"): (v, peft_sd[k.replace(".lora_A.", ".lora_B.")], alpha)
                    for k, v in peft_sd.items() if k.endswith(".lora_A.weight")}
        table_parts, shapes = _table(name, part)
        out.update(kohya.write(name, table_parts, adapters, shapes))
    return out


def write(folder: Path, module: torch.nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype,
          metadata: dict[str, str]) -> Path:
    """`<folder>/kohya.safetensors`, atomically, every tensor (alpha too, as sd-scripts does) in `dtype`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final = folder / WEIGHT_NAME
    partial = folder / (WEIGHT_NAME + ".partial")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors(module, weights).items()}, str(partial),
              metadata=metadata)
    os.replace(partial, final)
    return final


def read(path: Path, module: torch.nn.Module, component: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A kohya-layout file's LoRA of `module` (a LoRA-injected UNet, transformer or text encoder; `component` its
    pipeline name) as peft tensors for its adapters; with what of the file does not fit them."""
    from safetensors.torch import load_file

    state = load_file(str(path))
    config: Any = cast(Any, module).peft_config["default"]
    kind = _kind(module)
    if kind in lycoris.KEYS:
        from peft.tuners.tuners_utils import BaseTunerLayer

        modules = {n for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)}  # the adapted layers
        return lycoris.read(component, _table(component, module)[0], kind, state, modules, int(config.r),
                            float(config.alpha))
    adapted = {n.removesuffix(".lora_A.default.weight") for n, _ in module.named_parameters()
               if n.endswith(".lora_A.default.weight")}
    table_parts, shapes = _table(component, module)
    return kohya.read(component, table_parts, state, shapes, adapted, int(config.r), float(config.lora_alpha))
