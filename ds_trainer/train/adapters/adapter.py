"""What a run trains: the whole UNet (`adapter=none`) or peft's adapters on a frozen UNet (`adapter=lora`, `dora`,
`lokr`, `loha`).

The recipe calls it at named points: `build` after loading the UNet (inject, freeze, cast the frozen
base to 16-bit), `parameters` for the optimizer, `after_prepare` once the backend holds the module, `save_kwargs`
for checkpoints that hold the trainable state only, `on_save` with each checkpoint and `export` at the end (the
adapters' files: diffusers' layout, kohya's or LyCORIS').
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import formats
from ds_trainer.config.problems import Problem
from ds_trainer.train import families
from ds_trainer.train.adapters import kohya_file, lora_file, quantize
from ds_trainer.train.adapters.lora_file import adaptable_names
from ds_trainer.train.adapters.names import is_adapter
from ds_trainer.train.families import common, text_encoders

if TYPE_CHECKING:
    from ds_trainer.train.backends.params import Whole
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")



def enabled(cfg: DictConfig) -> bool:
    return bool(cfg.adapter.method.value != "none")


def lora_config(cfg: DictConfig) -> Any:
    """peft's config of `cfg.adapter` (`peft_config`)."""
    a = cfg.adapter
    return peft_config(a.method.value, int(a.rank), int(a.alpha), tuple(a.targets), float(a.dropout), int(a.factor))


def peft_config(method: str, rank: int, alpha: int, targets: tuple[str, ...], dropout: float = 0.0,
                factor: int = -1) -> Any:
    """peft's config of an adapter: LoRA (B starts at zero), DoRA (LoRA with `use_dora`; its magnitudes start at
    the base's row norms), LoKr (w1 starts at zero) or LoHa (w2_b starts at zero): the adapted UNet starts as the
    base whatever the method."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if method == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, target_modules=list(targets), decompose_factor=factor)
    if method == "loha":
        return LoHaConfig(r=rank, alpha=alpha, target_modules=list(targets))
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                      init_lora_weights="gaussian", use_dora=method == "dora")


def inject(cfg: DictConfig, model: torch.nn.Module) -> None:
    """Freeze the UNet, then add the adapters (peft makes only them trainable); those on layers whose output feeds
    nothing (the family's `unused`) stay frozen."""
    model.requires_grad_(False)
    model.add_adapter(lora_config(cfg))  # type: ignore[operator]
    _freeze_unused(model)


def _freeze_unused(model: torch.nn.Module) -> None:
    """The layers whose output feeds nothing the loss sees (the family's `unused`: Qwen-Image's last text-stream
    layers), and any adapters on them, frozen: they would never get a gradient, which DDP refuses."""
    for name in families.of_module(model).unused(model):
        model.get_submodule(name).requires_grad_(False)


def _register_external(module: torch.nn.Module, layout: Whole) -> int:
    """ZeRO-3: LoKr's and LoHa's factors live in parameter dicts no forward calls, and DoRA, LoKr and LoHa read the
    base layer's weight outside the base layer's forward; DeepSpeed gathers and releases a parameter around the
    forward and backward of the modules that call it. Every parameter of each adapted layer is registered with
    that layer (`register_external_parameter`), so the layer holds them whole from its forward through its
    backward. Returns how many layers."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = 0
    for layer in module.modules():
        if isinstance(layer, BaseTunerLayer):
            for p in layer.parameters():
                if layout.partitioned(p):
                    register_external_parameter(layer, p)
            layers += 1
    return layers


def _meta_model(cfg: DictConfig) -> torch.nn.Module:
    return families.of(cfg).meta_trained(cfg)


def inspect(cfg: DictConfig) -> tuple[list[Problem], int]:
    """Before training, on the models built on the meta device (no memory): the problems only the model
    shows (targets that match no module, listing the names that exist; an `adapter.init_from` file whose
    tensors do not fit) and the number of trainable parameters (the UNet's and the trained text encoders')."""
    rules, count = _inspect_model(cfg)
    more, encoders = _inspect_encoders(cfg)
    return rules + more, count + encoders


def _inspect_encoders(cfg: DictConfig) -> tuple[list[Problem], int]:
    """`text_encoders.targets` that match nothing in a trained encoder, and the encoders' trainable parameters."""
    if not text_encoders.enabled(cfg):
        return [], 0
    from ds_trainer.train.families.common import source

    path, kwargs = source(cfg)
    rules: list[Problem] = []
    count = 0
    for name in text_encoders.trained(cfg):
        encoder = text_encoders.meta_encoder(path, name, **kwargs)
        if cfg.text_encoders.mode.value == "lora":
            ends = [str(t) for t in cfg.text_encoders.targets]
            names = [n for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)]
            unmatched = [t for t in ends if not any(n == t or n.endswith("." + t) for n in names)]
            if unmatched:
                rules.append(Problem("text_encoders.targets", ends, f"{', '.join(unmatched)}: no Linear module of "
                                     f"{name} has such a name; the names end with: "
                                     f"{', '.join(text_encoders.module_endings(encoder))}",
                                     "text_encoders.targets=[q_proj,k_proj,v_proj,out_proj] (the attention "
                                     "projections; fc1, fc2: the MLP)"))
                continue
        text_encoders.prepare_encoder(text_encoders.Spec.of(cfg), name, encoder)
        count += sum(p.numel() for p in encoder.parameters() if p.requires_grad)
        if enabled(cfg) and cfg.adapter.init_from is not None and cfg.text_encoders.mode.value == "lora":
            unfit = lora_file.mismatch(Path(cfg.adapter.init_from), encoder, name)
            if unfit:
                rules.append(unfit)
    return rules, count


def _targets_fix(targets: list[str], unmatched: list[str]) -> str:
    """The targets asked for that the module has (adapter=lora_wide's UNet names on a transformer:
    its feed-forward ones), else the attention projections every family has."""
    matched = [t for t in targets if t not in unmatched]
    if matched:
        return f"adapter.targets=[{','.join(matched)}] (those of the list it has)"
    return "adapter.targets=[to_q,to_k,to_v,to_out.0] (or adapter=lora_wide)"


def _inspect_model(cfg: DictConfig) -> tuple[list[Problem], int]:
    if not enabled(cfg):
        return [], int(cfg.model.param_count)
    model = _meta_model(cfg)
    names = adaptable_names(model)
    unmatched = [t for t in cfg.adapter.targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        endings = sorted({".".join(n.split(".")[-2:]) if n.split(".")[-1].isdigit() else n.split(".")[-1]
                          for n in names})
        return [Problem("adapter.targets", list(cfg.adapter.targets),
                        f"{', '.join(unmatched)}: no Linear/Conv module of the {families.label_of(model)} has such a "
                        f"name; the names end with: {', '.join(endings)}",
                        _targets_fix(list(cfg.adapter.targets), unmatched))], 0
    inject(cfg, model)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.adapter.init_from is not None:
        unfit = lora_file.mismatch(Path(cfg.adapter.init_from), model, families.component_of(model))
        if unfit:
            return [unfit], count
    return [], count


@dataclass
class Trained:
    """What trains: the UNet, or the UNet and the trained text encoders as one module (`text_encoders.Denoiser`).
    `names` are the LoRA parameters' names in `module` (empty: nothing is a LoRA); with a full fine-tune of
    everything every method does what the UNet's full fine-tune did."""

    cfg: DictConfig
    module: torch.nn.Module
    names: list[str] = field(default_factory=list)  # the LoRA parameters' names, in `module`

    @property
    def lora(self) -> bool:
        return bool(self.names)

    @property
    def full(self) -> bool:
        """Whether some component (the UNet, a text encoder) trains whole: exported as a model."""
        return any(not text_encoders.is_lora(part) for _, part in text_encoders.components(self.module))

    @property
    def partial(self) -> bool:
        """Whether some parameters of the module are frozen (a LoRA's base, CLIP-L's unused last layer)."""
        return any(not p.requires_grad for p in self.module.parameters())

    @property
    def parameters(self) -> Iterable[Any]:
        """What the optimizer gets: the trainable parameters only (frozen ones would get fp32 copies), in a group
        per component when text encoders train (their own learning rate)."""
        groups = text_encoders.parameter_groups(self.cfg, self.module)
        if groups is not None:
            return groups
        if not self.partial:
            return self.module.parameters()
        return [p for p in self.module.parameters() if p.requires_grad]

    def count(self) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    def save_kwargs(self, run: Run) -> dict[str, Any]:
        """`accelerator.save_state` keyword arguments: a module with frozen parameters is saved without them (they
        come from the model at a resume, not from the checkpoint); the backend says how."""
        return run.backend.keep_trainable_only(run.accelerator) if self.partial else {}

    def after_prepare(self, run: Run) -> None:
        """Collective, after `accelerator.prepare`: exact fp32 masters from `adapter.init_from`; under ZeRO-3 the
        parameters of DoRA's, LoKr's and LoHa's layers registered with them."""
        layout, module = run.params, run.accelerator.unwrap_model(run.model)
        if self.cfg.quantize.kind.value != "none" and layout.shards:
            held = quantize.partitioned_bytes(module, layout)
            log.info("quantize=%s under %s: this rank holds %.2f MiB of the packed base weights (its partition of "
                     "%.2f MiB) and %.2f MiB of their scales (whole on every rank)", self.cfg.quantize.kind.value,
                     layout.sharder.split()[0], held[0] / 2**20, held[1] / 2**20, held[2] / 2**20)
        if self.lora and enabled(self.cfg) and self.cfg.adapter.method.value != "lora":
            if any(layout.partitioned(p) for p in module.parameters()):
                log.info("adapter=%s under ZeRO-3: %d adapted layers gather their base weight and adapters "
                         "together", self.cfg.adapter.method.value, _register_external(module, layout))
        if self.partial and self.lora and enabled(self.cfg) and self.cfg.adapter.init_from is not None:
            lora_file.set_fp32(module, self.names, Path(self.cfg.adapter.init_from), layout)

    def on_save(self, run: Run) -> None:
        """Collective, after each checkpoint: the LoRA file of the weights so far."""
        if self.lora:
            self.export(run)

    def export(self, run: Run) -> None:
        """Collective: the LoRA files in `<run>/lora/` (and `<run>/lora_ema/` with EMA) from the fp32 master weights,
        gathered on every rank whatever the ZeRO stage; rank 0 writes, as `adapter.formats` asks: diffusers'
        `pytorch_lora_weights.safetensors` (`unet.`, `text_encoder.`, `text_encoder_2.` keys) and kohya's
        `kohya.safetensors` (lora_unet_*, lora_te1_*, lora_te2_*), every LoRA of the run in each."""
        accelerator, ema, run_dir = run.accelerator, run.ema, run.run_dir
        module = accelerator.unwrap_model(run.model)
        weights = lora_file.gather_fp32(module, self.names, run.params, accelerator.is_main_process)
        shadow = ema.full(dst=0, device="cpu") if ema is not None else None  # collective: sharded over the ranks
        if not accelerator.is_main_process:
            return
        dtype = common.SAVE_DTYPES[self.cfg.adapter.save_dtype.value]
        averaged = {n: v for n, v in shadow.items() if n in set(self.names)} if shadow is not None else None
        for folder, values in (("lora", weights), ("lora_ema", averaged)):
            if values is None:
                continue
            for name in formats.names(self.cfg.adapter.formats):
                LORA_WRITERS[name](run, run_dir / folder, module, values, dtype)


def _diffusers_lora(run: Run, folder: Path, module: torch.nn.Module,  # noqa: ARG001 - a writer's signature
                    values: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    lora_file.write(folder, module, values, dtype)


def _kohya_lora(run: Run, folder: Path, module: torch.nn.Module, values: dict[str, torch.Tensor],
                dtype: torch.dtype) -> None:
    from ds_trainer.train.layouts import metadata

    header = metadata.kohya_lora(run.cfg, run.family, run.run_dir, folder.name == "lora_ema")
    kohya_file.write(folder, module, values, dtype, header)


# How each of adapter.formats (config/formats.py's LoRA records) is written into a LoRA folder.
LORA_WRITERS: dict[str, Callable[[Run, Path, torch.nn.Module, dict[str, torch.Tensor], torch.dtype], None]] = {
    "diffusers": _diffusers_lora, "kohya": _kohya_lora}


def quantize_base(cfg: DictConfig, model: torch.nn.Module, device: torch.device, layout: Whole) -> quantize.Quantized:
    """`quantize=int8|nf4`: the frozen base's linear layers quantized on `device`, computing in the base's dtype;
    peft then adds its bitsandbytes LoRA layers around them (`layout`: the backend's, which may shard them)."""
    kind = cfg.quantize.kind.value
    compute = common.lora_base_dtype(cfg) or torch.float32
    model.requires_grad_(False)
    sharder = layout.sharder
    # Sharded, the packed weights are held in the compute dtype: the one ZeRO-3 gathers in and FSDP2's all-gather casts
    # to, so neither changes their bits; their scales stay on the module, whole on each rank.
    done = quantize.apply(model, kind, compute, device, float(cfg.quantize.threshold),
                          compiled=cfg.train.compile.value != "none", storage=compute if sharder else torch.uint8)
    # peft's bitsandbytes dispatch reads these (transformers sets them when it loads a quantized model)
    model.is_loaded_in_8bit, model.is_loaded_in_4bit = kind == "int8", kind == "nf4"  # type: ignore[assignment]
    log.info("quantize=%s: %d linear layers of the %s's frozen base as %s, %.1f MiB (%.1f MiB before); samples "
             "and validation run on the quantized model, the LoRA files are the unquantized base's%s", kind,
             done.layers, families.label_of(model), quantize.KINDS[kind], done.after / 2**20, done.before / 2**20,
             f"; packed in {str(compute).removeprefix('torch.')} tensors that {sharder} over the ranks "
             "(their scales whole on each)" if sharder else "")
    return done


def _lora_names(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.requires_grad and is_adapter(n)]


def build(cfg: DictConfig, model: torch.nn.Module, encoders: dict[str, torch.nn.Module] | None = None,
          where: tuple[torch.device, Whole] | None = None) -> Trained:
    """Before `accelerator.prepare`: with `adapter=lora` inject the adapters, freeze and cast the base to
    the training precision's 16-bit type (the adapters stay fp32), and load `adapter.init_from`; with trained text
    encoders (`text_encoders.take` made them trainable) the UNet and them as one module. With `quantize=int8|nf4`
    and `where` (the run's device and the backend's layout; without them the module only names the adapters) the
    base's linear layers are quantized on the device first. Either way the layers whose output feeds nothing (the
    family's `unused`) stay frozen."""
    if enabled(cfg):
        base = sum(p.numel() for p in model.parameters())  # before quantization packs two 4-bit weights a byte
        if cfg.quantize.kind.value != "none" and where is not None:
            quantize_base(cfg, model, *where)
        inject(cfg, model)
        if cfg.quantize.kind.value != "none" and where is not None:
            # peft's bitsandbytes and torchao LoRA layers make their adapters in the quantized layer's compute dtype
            # (bf16): in fp32, as on a 16-bit base, or DDP's AdamW would step bf16 adapters (small updates round away)
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    p.data = p.data.float()
        half = common.lora_base_dtype(cfg)
        if half is not None:
            common.cast_frozen(model, half)
        if cfg.adapter.init_from is not None:
            lora_file.load_into(Path(cfg.adapter.init_from), model, families.component_of(model))
            log.info("adapter=%s initialised from %s", cfg.adapter.method.value, cfg.adapter.init_from)
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = base + count
        log.info("adapter=%s: training %d of %d %s parameters (%.2f%%), rank %d, alpha %g, targets %s%s",
                 cfg.adapter.method.value, count, total, families.label_of(model), 100 * count / total,
                 cfg.adapter.rank, cfg.adapter.alpha, list(cfg.adapter.targets),
                 f", factor {cfg.adapter.factor}" if cfg.adapter.method.value == "lokr" else "")
    else:
        _freeze_unused(model)
    module: torch.nn.Module = text_encoders.Denoiser(model, encoders) if encoders else model
    if enabled(cfg) and cfg.adapter.init_from is not None:  # the file's encoder adapters too (inspect checked them)
        for name, part in (encoders or {}).items():
            if text_encoders.is_lora(part):
                lora_file.load_into(Path(cfg.adapter.init_from), part, name)
    return Trained(cfg, module, _lora_names(module))
