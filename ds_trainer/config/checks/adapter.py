"""The `adapter` and `text_encoders` groups: what their values alone show. Torch-free, read-only.

Whether `adapter.targets` match modules of the UNet, and whether an `adapter.init_from` file fits, need
the model's module names; `train.adapter.inspect` checks those before training starts.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from omegaconf import DictConfig

from ds_trainer.config import ds_config, formats, hardware, schema
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """Problems of `cfg.adapter`, `cfg.text_encoders` and `cfg.quantize` that the values (and the
    platform) show."""
    out = _text_encoders(cfg) + _quantize(cfg)
    a = cfg.adapter
    if a.method.value == "none":
        return out + _model_formats(cfg)
    out += _lora_shape("adapter", a, 16, "[to_q,to_k,to_v,to_out.0] (or adapter=lora_wide)")
    out += _method(cfg, info)
    if a.init_from is not None and not Path(a.init_from).exists():
        out.append(Problem("adapter.init_from", a.init_from, "no such file or folder",
                           "adapter.init_from=<run>/lora/pytorch_lora_weights.safetensors (or null)"))
    return out


def _text_encoders(cfg: DictConfig) -> list[Problem]:
    if not schema.trains_text_encoders(cfg):
        return []
    te = cfg.text_encoders
    out: list[Problem] = []
    if te.lr is not None and (not math.isfinite(te.lr) or te.lr <= 0):
        out.append(Problem("text_encoders.lr", te.lr, "the text encoders' learning rate must be a positive number",
                           "text_encoders.lr=1e-5 (or null: the UNet's optimizer.lr)"))
    if te.warmup_steps is not None:
        schedule = cfg.scheduler.name.value
        if te.warmup_steps <= 0:
            out.append(Problem("text_encoders.warmup_steps", te.warmup_steps, "a warm-up is a positive number of steps",
                               "text_encoders.warmup_steps=100 (or null: the schedule's scheduler.warmup_steps)"))
        elif schedule in ("constant", "one_cycle"):
            out.append(Problem("text_encoders.warmup_steps", te.warmup_steps, f"the encoders warm up on the UNet's "
                               f"schedule family, and scheduler={schedule} has no warm-up",
                               "scheduler=warmup (or warmup_decay, warmup_cosine), or text_encoders.warmup_steps=null"))
    if te.mode.value == "lora":
        out += _lora_shape("text_encoders", te, 8, "[q_proj,k_proj,v_proj,out_proj]")
    return out


def _lora_shape(group: str, node: DictConfig, rank: int, targets: str) -> list[Problem]:
    """A LoRA's rank, alpha, dropout and targets (`adapter` or `text_encoders`); `rank` and `targets`: the fixes."""
    out: list[Problem] = []
    if node.rank <= 0:
        out.append(Problem(f"{group}.rank", node.rank, "the LoRA rank must be a positive integer",
                           f"{group}.rank={rank}"))
    if not math.isfinite(node.alpha) or node.alpha <= 0:
        out.append(Problem(f"{group}.alpha", node.alpha,
                           "the LoRA alpha (the update is scaled by alpha/rank) must be > 0",
                           f"{group}.alpha={max(node.rank, 1)}"))
    if not math.isfinite(node.dropout) or not 0.0 <= node.dropout < 1.0:
        out.append(Problem(f"{group}.dropout", node.dropout, "must lie in [0, 1)", f"{group}.dropout=0.0"))
    if not node.targets:
        out.append(Problem(f"{group}.targets", [], "LoRA needs at least one module to adapt",
                           f"{group}.targets={targets}"))
    return out


def _quantize(cfg: DictConfig) -> list[Problem]:
    """`quantize=int8|nf4|fp8`: a LoRA's frozen base, under the backends that keep the quantized weights whole (and
    ZeRO-3 and FSDP2, which partition nf4's packed weights held in the compute dtype)."""
    q = cfg.quantize
    kind = q.kind.value
    if kind == "none":
        return []
    out: list[Problem] = []
    if cfg.adapter.method.value == "none":
        out.append(Problem("quantize", kind, "quantizes the frozen base of a LoRA; adapter=none trains every weight, "
                           "and a packed integer weight cannot train", "adapter=lora, or quantize=none"))
    option = ds_config.zero_option(cfg)
    if option.startswith("fsdp") and kind != "nf4":
        out.append(Problem("quantize", kind, f"zero={option}: FSDP2 shards each parameter as a DTensor in one dtype; "
                           + ("LLM.int8's weights are int8 tensors with their row scales on the parameter "
                              "(bitsandbytes has no float storage for them, as it has for nf4)" if kind == "int8" else
                              "torchao's float8 weight is a tensor subclass (its e4m3 values and scales inside), which "
                              "a shard would not carry"),
                           "quantize=nf4 (under FSDP2 its packed weights are held in the compute dtype and sharded), "
                           "or zero=stage2 or zero=ddp (a LoRA's base is not sharded below ZeRO-3)"))
    elif option == "stage3" and kind == "int8":
        out.append(Problem("quantize", kind, "ZeRO-3 partitions every parameter of the module and gathers it in the "
                           "training dtype; LLM.int8's weights are int8 tensors with their row scales on the parameter "
                           "(bitsandbytes has no 16-bit storage for them, as it has for nf4)",
                           "quantize=nf4 (under ZeRO-3 its packed weights are held in the compute dtype and "
                           "partitioned), or zero=stage2 or zero=ddp (a LoRA's base is not sharded below ZeRO-3; "
                           "quantized it is a quarter of bf16's size)"))
    elif option == "stage3" and kind == "fp8":
        out.append(Problem("quantize", kind, "ZeRO-3 partitions every parameter by replacing its data with a flat "
                           "slice; torchao's float8 weight is a tensor subclass (its e4m3 values and scales inside), "
                           "which a slice would not carry", "quantize=nf4 (partitioned under ZeRO-3), or zero=stage2 "
                           "or zero=ddp"))
    library, install = (("torchao", "pip install 'torchao>=0.16'") if kind == "fp8" else
                        ("bitsandbytes", "pip install 'bitsandbytes>=0.50' (CPU and CUDA wheels)"))
    if importlib.util.find_spec(library) is None:
        out.append(Problem("quantize", kind, f"needs {library}, which is not installed", f"{install}, or "
                           "quantize=none"))
    if kind == "int8" and (not math.isfinite(q.threshold) or q.threshold < 0):
        out.append(Problem("quantize.threshold", q.threshold, "is the activation magnitude above which LLM.int8 "
                           "computes in 16-bit (0: never)", "quantize.threshold=6.0"))
    return out


def _method(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """DoRA, LoKr and LoHa: the file layouts that load them, and what peft's layers of them do not have."""
    a = cfg.adapter
    method = a.method.value
    out = _formats(cfg)
    if method in schema.LYCORIS_METHODS:
        if a.dropout != 0:
            out.append(Problem("adapter.dropout", a.dropout, f"peft's {method} layers have no dropout on their "
                               "input (LoRA's); their rank and module dropouts are not offered", "adapter.dropout=0.0"))
        if cfg.quantize.kind.value == "nf4":  # int8's and fp8's weights keep their shape
            out.append(Problem(
                "adapter", method, f"peft's {method} layers reshape their product to the base "
                "layer's weight, which bitsandbytes packs for nf4 (a 4-bit weight is half a byte an "
                "element, stored flat); peft has no bitsandbytes version of them",
                "adapter=lora or adapter=dora with quantize=nf4, or quantize=int8 (or fp8, or none)"))
    if method == "lokr" and (a.factor == 0 or a.factor < -1):
        out.append(Problem("adapter.factor", a.factor, "LoKr's factor is the size of its smaller Kronecker matrix "
                           "(at least 1), or -1 for as square as the layer allows", "adapter.factor=-1 (or 4, 8, 16)"))
    if method == "dora" and cfg.quantize.kind.value == "int8" and info.kind == "cpu":
        # peft 0.21's dequantize_module_weight moves a CPU weight back with Int8Params.to, which
        # leaves its scales behind (bitsandbytes moved them into the layer's state at the first
        # forward): the next forward has none
        out.append(Problem(
            "adapter", method, "on the CPU peft's DoRA drops LLM.int8's row scales when it "
            "measures the base weight's norm (it moves the weight again with bitsandbytes' "
            "Int8Params.to, which leaves them behind): the second step would fail",
            "quantize=nf4 with adapter=dora, adapter=lora with quantize=int8, or a CUDA GPU"))
    if method == "dora" and cfg.quantize.kind.value == "fp8":
        out.append(Problem("adapter", method, "peft's LoRA layer on a torchao weight (quantize=fp8) has no DoRA: its "
                           "magnitude is the norm of the dequantized base, which that layer does not compute",
                           "adapter=lora with quantize=fp8, or adapter=dora with quantize=nf4"))
    return out


def _model_formats(cfg: DictConfig) -> list[Problem]:
    """A full fine-tune that exports writes at least one model format."""
    if not cfg.train.export or formats.names(cfg.export.formats):
        return []
    return [Problem("export.formats", "[]", "writes no model file: the trained weights would be lost at the run's "
                    "end", f"export.formats=[{','.join(formats.MODEL)}], or train.export=false for no export")]


def _formats(cfg: DictConfig) -> list[Problem]:
    """Each LoRA format asked for holds the method (config/formats.py says which ones); at least one is asked."""
    method, asked = cfg.adapter.method.value, formats.names(cfg.adapter.formats)
    if method == "none":
        return []
    able = formats.for_method(method)
    shown = "[" + ",".join(asked) + "]"
    if not asked:
        return [Problem("adapter.formats", "[]", "writes no LoRA file: the run's adapters would be lost at its end",
                        f"adapter.formats=[{','.join(able)}]")]
    return [Problem("adapter.formats", shown, formats.LORA[name].cannot[method], f"adapter.formats=[{','.join(able)}]"
                    f" ({' or '.join(formats.LORA[f].readers for f in able)} load it)")
            for name in asked if method not in formats.LORA[name].methods]

