"""The diffusers LoRA file: gathering the adapters' fp32 masters under any ZeRO stage, writing
`pytorch_lora_weights.safetensors` (keys `unet.<module>.lora.down/up.weight`, peft config in the
`lora_adapter_metadata` metadata), and reading one back for `adapter.init_from` (or a kohya-layout file, through
kohya_file.py).

Under ZeRO-3 `state_dict()` of the module holds empty placeholders for every tensor above
`stage3_param_persistence_threshold`; the adapters are read with `safe_get_full_fp32_param` instead,
which every rank must call (it is a collective).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_trainer.config.problems import Problem
from ds_trainer.train.adapters.names import is_adapter, peft_name

if TYPE_CHECKING:
    from ds_trainer.train.backends.params import Whole

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def adaptable_names(model: torch.nn.Module) -> list[str]:
    """Names of the modules LoRA can adapt (Linear and Conv layers)."""
    kinds = (torch.nn.Linear, torch.nn.Conv2d)
    return [n for n, m in model.named_modules() if isinstance(m, kinds) and not is_adapter(n)]


def gather_fp32(module: torch.nn.Module, names: list[str], layout: Whole, keep: bool) -> dict[str, torch.Tensor]:
    """Collective: the fp32 master value of every named parameter, on the CPU where `keep` (rank 0)."""
    named = dict(module.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name in names:
        value = layout.fp32(named[name])
        if keep:
            out[name] = value.detach().to("cpu", torch.float32).clone()
    return out


def set_fp32(module: torch.nn.Module, names: list[str], path: Path, layout: Whole) -> None:
    """Collective, after `accelerator.prepare`: set the fp32 masters of the adapters to the file's values
    (DeepSpeed made its masters from the 16-bit module, which rounded what `load_into` had set)."""
    values = read_module(path, module)
    named = dict(module.named_parameters())
    for name in names:
        layout.set_fp32(named[name], values[peft_name(name)].to(torch.float32))


def write(folder: Path, module: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> Path:
    """Write `weights` (named like the module's parameters) as a diffusers LoRA file, atomically: the UNet's
    adapters under `unet.`, a trained text encoder's under `text_encoder.` / `text_encoder_2.`, each part's peft
    config in the file's metadata, so that one `load_lora_weights` call loads them all."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    from ds_trainer.train import families
    from ds_trainer.train.families import text_encoders

    kwargs: dict[str, Any] = {}
    whole = not isinstance(module, text_encoders.Denoiser)
    part: Any
    for name, part in text_encoders.components(module):
        mine = weights if whole else text_encoders.split(weights, name)
        if not mine or not text_encoders.is_lora(part):
            continue  # a fully trained component: exported as a model, not in the LoRA file
        peft_sd = get_peft_model_state_dict(part, state_dict=mine)
        # A transformer's keys stay peft's (`...to_q.lora_A.weight`), as diffusers' SD3 loader reads them.
        layers = peft_sd if name == "transformer" else convert_state_dict_to_diffusers(peft_sd)
        kwargs[f"{name}_lora_layers"] = {k: v.to(dtype).contiguous() for k, v in layers.items()}
        kwargs[f"{name}_lora_adapter_metadata"] = part.peft_config["default"].to_dict()
    tmp = folder / ".partial"
    tmp.mkdir(parents=True, exist_ok=True)
    trained = module.unet if isinstance(module, text_encoders.Denoiser) else module
    pipeline = families.of_module(trained).lora_pipeline()
    pipeline.save_lora_weights(tmp, **kwargs, safe_serialization=True)
    final = folder / WEIGHT_NAME
    os.replace(tmp / WEIGHT_NAME, final)
    tmp.rmdir()
    return final


def read(path: Path, component: str = "unet") -> dict[str, torch.Tensor]:
    """A diffusers-format LoRA file (or its folder) as peft-named tensors of one component (`...to_q.lora_A.weight`):
    the UNet's (`unet.` keys), a transformer's (`transformer.`), or a text encoder's (`text_encoder.`,
    `text_encoder_2.`). Empty if it has none."""
    from diffusers.utils import convert_state_dict_to_peft, convert_unet_state_dict_to_peft
    from safetensors.torch import load_file

    file = path / WEIGHT_NAME if path.is_dir() else path
    state = load_file(file)
    mine = {k.removeprefix(f"{component}."): v for k, v in state.items() if k.startswith(f"{component}.")}
    if component == "unet":
        return dict(convert_unet_state_dict_to_peft(mine))
    if component == "transformer":  # written with peft's names
        return mine
    return dict(convert_state_dict_to_peft(mine)) if mine else {}


def is_kohya(path: Path) -> bool:
    """Whether `adapter.init_from` names a kohya-layout file (a folder holding both: the diffusers file is read)."""
    from ds_trainer.config.weights_file import safetensors_keys
    from ds_trainer.train.layouts import kohya

    if path.is_dir():
        return not (path / WEIGHT_NAME).is_file() and (path / "kohya.safetensors").is_file()
    try:
        return kohya.is_kohya(safetensors_keys(path))
    except (OSError, ValueError):
        return False


def read_for(path: Path, module: torch.nn.Module, component: str) -> dict[str, torch.Tensor]:
    """The file's LoRA of `module` (LoRA-injected; `component` its pipeline name) as peft tensors, from either
    layout; a kohya file's tensors this model has no adapter for raise ValueError."""
    if not is_kohya(path):
        return read(path, component)
    from ds_trainer.train.adapters import kohya_file

    state, problems = kohya_file.read(path / "kohya.safetensors" if path.is_dir() else path, module, component)
    if problems:
        raise ValueError(f"{len(problems)} of its kohya-layout modules do not fit this adapter: {problems[0]}")
    return state


def read_module(path: Path, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The file's tensors named as `module`'s parameters are without peft's adapter name: the UNet's, or with
    trained text encoders every component's under its prefix (`unet.`, `text_encoder.`, `text_encoder_2.`)."""
    from ds_trainer.train.families import text_encoders

    if not isinstance(module, text_encoders.Denoiser):
        from ds_trainer.train.families.base import component_of

        return read_for(path, module, component_of(module))
    return {f"{name}.{k}": v for name, part in text_encoders.components(module) if text_encoders.is_lora(part)
            for k, v in read_for(path, part, name).items()}


def trained_with(found: dict[str, tuple[int, ...]]) -> tuple[int | None, list[str]]:
    """The rank and the targets (module name endings, as `adapter.targets` spells them: `to_q`,
    `to_out.0`) a file's peft-named LoRA tensors were trained with."""
    ranks = {shape[0] for key, shape in found.items() if ".lora_A." in key and shape}
    endings = set()
    for key in found:
        module = key.split(".lora_")[0].split(".")
        numbered = module[-1].isdigit() and len(module) > 1  # to_out.0
        endings.add(".".join(module[-2:]) if numbered else module[-1])
    return (ranks.pop() if len(ranks) == 1 else None), sorted(endings)


def _file_rank(path: Path) -> int | None:
    """The rank of a LoRA file in either layout (the first dimension of its down/A matrices), from
    its header; None when they disagree or the file has none."""
    from ds_trainer.config.weights_file import safetensors_header

    file = path
    if path.is_dir():
        names = (WEIGHT_NAME, "kohya.safetensors")
        file = next((path / n for n in names if (path / n).is_file()), path)
    try:
        header = safetensors_header(file)
    except (OSError, ValueError):
        return None
    ranks = {v["shape"][0] for k, v in header.items() if isinstance(v, dict) and v.get("shape")
             and (".lora_A." in k or ".lora_down." in k)}
    return ranks.pop() if len(ranks) == 1 else None


def _other_parts(path: Path) -> list[str]:
    """The components a diffusers-format file holds LoRA tensors for (`transformer`, `unet`)."""
    from ds_trainer.config.weights_file import safetensors_keys

    try:
        keys = safetensors_keys(path / WEIGHT_NAME if path.is_dir() else path)
    except (OSError, ValueError):
        return []
    return sorted({k.split(".")[0] for k in keys if "." in k})


def mismatch(path: Path, module: torch.nn.Module, component: str = "unet") -> Problem | None:
    """Why the LoRA file at `path` (`adapter.init_from`) does not fit the adapters injected into
    `module` (the UNet, or the text encoder `component`), with the fix read from the file (its rank,
    its targets, the part it adapts); None when it fits."""
    from peft.utils import get_peft_model_state_dict

    given = str(path)
    targets = "adapter" if component in ("unet", "transformer") else "text_encoders"
    try:
        found = {k: tuple(v.shape) for k, v in read_for(path, module, component).items()}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to replace
        return _unread(path, module, component, exc)
    if not found:
        return _empty(path, component)
    rank, endings = trained_with(found)
    wanted = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(module).items()}
    missing, extra = sorted(set(wanted) - set(found)), sorted(set(found) - set(wanted))
    if missing or extra:
        return Problem("adapter.init_from", given, f"its adapted modules of {component} differ "
                       f"from {targets}.targets: {len(missing)} tensors missing (e.g. "
                       f"{missing[:1]}), {len(extra)} not expected (e.g. {extra[:1]})",
                       f"{targets}.targets=[{','.join(endings)}] (the modules the file adapts)")
    for name, shape in wanted.items():
        if found[name] != shape:
            fix = f"{targets}.rank={rank} (the file's rank)" if rank else ANOTHER
            return Problem("adapter.init_from", given, f"{component} {name} has shape "
                           f"{found[name]} (rank {rank}), this adapter needs {shape}", fix)
    return None


ANOTHER = "another file (a LoRA file this run's model and adapter wrote)"


def _unread(path: Path, module: torch.nn.Module, component: str, exc: Exception) -> Problem:
    """A file `read_for` could not read for `module`: a kohya file's modules that do not fit (the
    fix: its rank, where that is the difference), or one that is no LoRA file of this layout."""
    targets = "adapter" if component in ("unet", "transformer") else "text_encoders"
    if isinstance(exc, ValueError):
        rank, ours = _file_rank(path), getattr(module, "peft_config", {}).get("default")
        if rank is not None and ours is not None and rank != getattr(ours, "r", rank):
            return Problem("adapter.init_from", str(path), str(exc),
                           f"{targets}.rank={rank} (the file's rank)")
        return Problem("adapter.init_from", str(path), str(exc), ANOTHER)
    layout = "a kohya-layout" if is_kohya(path) else "a diffusers"
    return Problem("adapter.init_from", str(path), f"cannot be read as {layout} LoRA file "
                   f"({type(exc).__name__}: {exc})", ANOTHER)


def _empty(path: Path, component: str) -> Problem:
    """A file with no LoRA tensors for `component`: what it holds instead, and the fix."""
    from ds_trainer.train.layouts import kohya

    kohya_layout = is_kohya(path)
    keys = f"{kohya.PREFIX[component]}*" if kohya_layout else f"{component}."
    parts = [] if kohya_layout else [p for p in _other_parts(path) if p != component]
    held = f"; it holds LoRA tensors for: {', '.join(parts)}" if parts else ""
    if component not in ("unet", "transformer"):
        return Problem("adapter.init_from", str(path), f"holds no LoRA tensors for {component} (no "
                       f"`{keys}` keys): it was trained with that encoder frozen{held}",
                       "text_encoders=frozen to continue the denoiser's adapters alone")
    part = "UNet" if component == "unet" else "transformer"
    return Problem("adapter.init_from", str(path), f"holds no {part} LoRA tensors (no `{keys}` "
                   f"keys){held}", "a LoRA file of this model's family (a run of the model it was "
                   "trained on takes this one), or adapter.init_from=null")


def load_into(path: Path, module: torch.nn.Module, component: str = "unet") -> None:
    """Set the injected adapters of `module` (the UNet, or the text encoder `component`) to the file's values."""
    from peft.utils import set_peft_model_state_dict

    state = {k: v.to(torch.float32) for k, v in read_for(path, module, component).items()}
    result = set_peft_model_state_dict(module, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"adapter.init_from={path}: tensors for no adapter of {component}: {unexpected[:3]}")
