"""SDXL's text encoders trained with the UNet (`text_encoders=lora|full`).

Accelerate hands DeepSpeed one model per engine, and a second engine for an encoder would be a second optimizer,
schedule and checkpoint that drift apart (diffusers' SDXL LoRA script asserts under DeepSpeed with
`--train_text_encoder`). So the UNet and the trained encoders become one module, `Denoiser`, which DeepSpeed (or
DDP) wraps whole: one engine, one optimizer with a parameter group per component (the encoders' at
`text_encoders.lr`), one checkpoint. Its parameter names are the component's name and the parameter's
(`unet.…`, `text_encoder.…`, `text_encoder_2.…`), which is how the portable state, the EMA and the LoRA file
tell the parts apart. A frozen encoder stays outside it, as with `text_encoders=frozen`: its embeddings are
cached; a trained one's are computed every step from the cached token ids.

SDXL conditions on the penultimate hidden state of both encoders and on OpenCLIP-bigG's pooled projection: CLIP-L's
last transformer layer and final layer norm feed nothing SDXL reads, so they get no gradient and stay frozen (an
adapter there would never move, and DDP would wait for its gradient forever). bigG's last layer, final norm and
projection feed the pooled embedding and train.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import schema
from ds_trainer.train.backends import params
from ds_trainer.train.families import common

log = logging.getLogger("ds_trainer")

# text_encoders.which -> the pipeline's component names (diffusers' names, also the LoRA file's key prefixes).
COMPONENTS = {"clip_l": ("text_encoder",), "bigg": ("text_encoder_2",), "both": ("text_encoder", "text_encoder_2")}
# What a batch carries for each encoder: its token ids when it trains, its cached embeddings when it is frozen.
IDS = {"text_encoder": "input_ids", "text_encoder_2": "input_ids_2"}
TEXT_KEYS = ("input_ids", "input_ids_2", "embeds_1", "embeds_2", "pooled")


def meta_encoder(path: Any, name: str, **kwargs: Any) -> torch.nn.Module:
    """The text encoder `name` (`text_encoder`: CLIP ViT-L, `text_encoder_2`: OpenCLIP bigG with its projection) of
    the diffusers folder or hub id `path`, on the meta device (no memory): its layers, for checks and the planner."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    classes: dict[str, Any] = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
    with torch.device("meta"):
        return classes[name](CLIPTextConfig.from_pretrained(path, subfolder=name, **kwargs))  # type: ignore[no-any-return]


def enabled(cfg: DictConfig) -> bool:
    return schema.trains_text_encoders(cfg)


def trained(cfg: DictConfig) -> tuple[str, ...]:
    """The component names of the encoders that train (empty with `text_encoders=frozen`)."""
    return COMPONENTS[cfg.text_encoders.which.value] if enabled(cfg) else ()


def lr(cfg: DictConfig) -> float:
    """The encoders' peak learning rate (the UNet's unless `text_encoders.lr` is set)."""
    value = cfg.text_encoders.lr
    return float(cfg.optimizer.lr if value is None else value)


def frozen_by_design(name: str, encoder: torch.nn.Module) -> list[str]:
    """Parameter-name prefixes of `encoder` that SDXL never reads (see the module's docstring): CLIP-L's last layer
    and final layer norm; nothing of OpenCLIP-bigG's."""
    if name != "text_encoder":
        return []
    # By module name: transformers 5 has CLIPTextModel's layers at `encoder.layers`, 4 at `text_model.encoder.layers`.
    layers = [n for n, _ in encoder.named_modules() if re.fullmatch(r"(.+\.)?encoder\.layers\.\d+", n)]
    last = max(layers, key=lambda n: int(n.rsplit(".", 1)[1]))
    norms = [n for n, _ in encoder.named_modules() if n.split(".")[-1] == "final_layer_norm"]
    return [f"{last}.", *(f"{n}." for n in norms)]


def lora_targets(targets: Iterable[str], name: str, encoder: torch.nn.Module) -> list[str]:
    """The full names of the Linear modules of `encoder` LoRA adapts: those ending with one of `targets`, outside what
    SDXL never reads."""
    skip = frozen_by_design(name, encoder)
    ends = [str(t) for t in targets]
    return [n for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)
            and any(n == t or n.endswith("." + t) for t in ends) and not any(n.startswith(s) for s in skip)]


def module_endings(encoder: torch.nn.Module) -> list[str]:
    """The last parts of the encoder's Linear module names (for the message when targets match nothing)."""
    return sorted({n.split(".")[-1] for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)})


@dataclass(frozen=True)
class Spec:
    """How the encoders train: `text_encoders`' keys, and the 16-bit type a LoRA's frozen base is cast to."""

    mode: str
    rank: int = 8
    alpha: int = 8
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    half: torch.dtype | None = None
    checkpointing: bool = False

    @classmethod
    def of(cls, cfg: DictConfig) -> Spec:
        te = cfg.text_encoders
        return cls(te.mode.value, int(te.rank), int(te.alpha), float(te.dropout), tuple(str(t) for t in te.targets),
                   common.lora_base_dtype(cfg), bool(cfg.train.gradient_checkpointing))


def prepare_encoder(spec: Spec, name: str, encoder: torch.nn.Module) -> None:
    """Make `encoder` trainable as `spec.mode` says, in place: LoRA adapters on a frozen base (cast to the
    precision's 16-bit type, as the UNet's base), or the whole encoder but the parts SDXL never reads."""
    from peft import LoraConfig

    encoder.requires_grad_(False)
    if spec.mode == "lora":
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                            target_modules=lora_targets(spec.targets, name, encoder), init_lora_weights="gaussian")
        encoder.add_adapter(config)  # type: ignore[operator]
        if spec.half is not None:
            common.cast_frozen(encoder, spec.half)
    else:
        skip = frozen_by_design(name, encoder)
        for n, p in encoder.named_parameters():
            p.requires_grad_(not any(n.startswith(s) for s in skip))
    if spec.checkpointing:
        encoder.gradient_checkpointing_enable()  # type: ignore[operator]
    encoder.train()


class Denoiser(torch.nn.Module):
    """The UNet and the trained text encoders as one module, for one DeepSpeed engine (see the module's docstring).

    Called like the training calls the UNet, with the batch's text inputs in place of the embeddings: the trained
    encoders encode their token ids, the frozen ones' cached embeddings are taken as they are."""

    def __init__(self, unet: torch.nn.Module, encoders: dict[str, torch.nn.Module]) -> None:
        super().__init__()
        self.unet = unet
        self.encoder_names = tuple(encoders)
        for name, encoder in encoders.items():
            self.add_module(name, encoder)

    def encoder(self, name: str) -> torch.nn.Module | None:
        return getattr(self, name) if name in self.encoder_names else None

    def encode(self, text: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """SDXL's conditioning (both encoders' penultimate hidden states side by side, bigG's pooled projection)."""
        te1, te2 = self.encoder("text_encoder"), self.encoder("text_encoder_2")
        first = te1(text["input_ids"], output_hidden_states=True).hidden_states[-2] if te1 is not None \
            else text["embeds_1"]
        if te2 is not None:
            out = te2(text["input_ids_2"], output_hidden_states=True)
            second, pooled = out.hidden_states[-2], out.text_embeds
        else:
            second, pooled = text["embeds_2"], text["pooled"]
        return torch.cat([first, second.to(first.dtype)], dim=-1), pooled

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, text: dict[str, torch.Tensor],
                time_ids: torch.Tensor) -> Any:
        embeds, pooled = self.encode(text)
        dtype = sample.dtype
        return self.unet(sample, timestep, embeds.to(dtype),
                         added_cond_kwargs={"text_embeds": pooled.to(dtype), "time_ids": time_ids.to(dtype)})


def take(cfg: DictConfig, frozen: Any) -> dict[str, torch.nn.Module]:
    """Before the frozen parts are cast and moved: the encoders that train, taken out of `frozen` (their slot there
    becomes None, so nothing treats them as frozen) and made trainable, in float32 like the UNet."""
    out: dict[str, torch.nn.Module] = {}
    spec = Spec.of(cfg)
    for name in trained(cfg):
        encoder = getattr(frozen, name)
        setattr(frozen, name, None)
        prepare_encoder(spec, name, encoder)
        out[name] = encoder
    return out


def parameter_groups(cfg: DictConfig, module: torch.nn.Module) -> list[dict[str, Any]] | None:
    """The optimizer's parameter groups of a Denoiser: the UNet's trainable parameters at optimizer.lr, the
    encoders' at `text_encoders.lr` (a schedule's LR follows each group's peak). None for a UNet alone."""
    if not isinstance(module, Denoiser):
        return None
    unet = [p for p in module.unet.parameters() if p.requires_grad]
    encoders = [p for name in module.encoder_names for p in getattr(module, name).parameters() if p.requires_grad]
    return [{"params": unet}, {"params": encoders, "lr": lr(cfg)}]


def counts(module: torch.nn.Module) -> dict[str, int]:
    """Trainable parameters by component (the UNet alone: {"unet": n}), whole under ZeRO-3's partitioning too."""
    def trainable(part: torch.nn.Module) -> int:
        return sum(params.numel(p) for p in part.parameters() if p.requires_grad)

    return {name: trainable(part) for name, part in components(module)}


def describe(cfg: DictConfig, module: torch.nn.Module) -> None:
    """Log what trains, per component (rank 0)."""
    if not isinstance(module, Denoiser):
        return
    parts = ", ".join(f"{name} {n:,}" for name, n in counts(module).items())
    log.info("text_encoders=%s (%s) train with the UNet in one module at lr %g: trainable parameters %s",
             cfg.text_encoders.mode.value, "+".join(module.encoder_names), lr(cfg), parts)


def split(weights: dict[str, torch.Tensor], component: str) -> dict[str, torch.Tensor]:
    """The tensors of one component of a Denoiser's state, named as in the component itself."""
    prefix = component + "."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def is_lora(part: torch.nn.Module) -> bool:
    """Whether a component trains as LoRA adapters (peft injected them through its `add_adapter`)."""
    return bool(getattr(part, "_hf_peft_config_loaded", False))


def components(module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    """(pipeline component name, module) of everything that trains: the UNet (or a family's transformer) alone, or a
    Denoiser's parts."""
    from ds_trainer.train.families.base import component_of

    if isinstance(module, Denoiser):
        yield "unet", module.unet
        for name in module.encoder_names:
            yield name, getattr(module, name)
    else:
        yield component_of(module), module
