"""`precision` on this machine: the dtypes its device computes in, the attention kernel it computes with
(`train.attention`), and the compiler that builds its kernels (`train.compile`). Torch-free, read-only.

(What each precision means under a backend is `resolve.precision_meaning`; bf16 masters under a backend that keeps
fp32 ones are `backend`'s rule.)
"""

from __future__ import annotations

import importlib.util
import shutil

from omegaconf import DictConfig

from ds_trainer.config import ds_config, families, hardware, optimizers, toolkit
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """bf16 or fp16 where the device has no kernels for it; fp16 for the flow-matching transformers."""
    precision, out = cfg.precision.name.value, []
    if precision in ("bf16", "bf16_pure") and not info.bf16:
        out.append(Problem("precision", precision, f"this {info.gpu_name or info.kind} has no bf16 support",
                           "precision=fp16"))
    if precision == "fp16" and not info.fp16:
        out.append(Problem("precision", "fp16", f"{info.kind} has no fp16 kernels here (DeepSpeed's CPU accelerator "
                           "needs AVX512-FP16 or AMX-FP16)", "precision=bf16 (or precision=fp32)"))
    spec = families.of(cfg)
    if precision == "fp16" and spec.fp16:
        out.append(Problem("precision", "fp16", f"model.family={spec.name}: {spec.fp16}",
                           "precision=bf16 (GPUs from Ampere on), or precision=fp32"))
    return out + _attention(cfg, info) + _compile(cfg, info) + _triton_tools(cfg, info)


def _attention(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """train.attention: a kernel the device has, for the dtype the run computes in (torch would fail at the first
    attention layer with "No available kernel")."""
    kernel, kind = cfg.train.attention.value, info.kind
    if kernel in ("sdpa", "math"):
        return []
    fix = "train.attention=sdpa (torch picks), or train.attention=math"
    if kind != "cuda" and not (kind == "cpu" and kernel == "flash"):
        has = "flash and math" if kind == "cpu" else "math"
        return [Problem("train.attention", kernel, f"torch's {kernel} attention kernel runs on CUDA GPUs; on {kind} "
                        f"scaled_dot_product_attention has {has}", fix)]
    if kind == "cuda" and not info.bf16:  # compute capability under 8.0 (bf16 is the flag for it: hardware.py)
        if kernel in ("flash", "cudnn"):
            return [Problem("train.attention", kernel, f"torch's {kernel} attention needs an Ampere or newer GPU "
                            f"(compute capability 8.0); this is {info.gpu_name or 'an older GPU'}",
                            "train.attention=efficient, or " + fix)]
    if kind != "cuda":
        return []
    label = {"flash": "FlashAttention", "cudnn": "cuDNN's attention"}.get(kernel, "")
    spec = families.of(cfg)
    if label and cfg.precision.name.value == "fp32":
        why = f"{label} computes in fp16 or bf16, and precision=fp32 runs attention in fp32"
        return [Problem("train.attention", kernel, why,
                        "precision=bf16, or train.attention=efficient (fp32 too)")]
    if kernel == "flash" and spec.attention_mask:
        why = (f"model.family={spec.name} trains with each caption's padding mask in its "
               "attention, and CUDA's FlashAttention kernel takes no mask")
        return [Problem("train.attention", kernel, why,
                        "train.attention=efficient or cudnn (both take a mask), or sdpa")]
    return _sampled_in_fp32(cfg, kernel, label)


def _sampled_in_fp32(cfg: DictConfig, kernel: str, label: str) -> list[Problem]:
    """DDP's full fine-tune holds its fp32 weights in the module, and the sampler runs the live
    module without autocast: its attention gets fp32, which flash and cuDNN's kernels do not take."""
    fp32_module = ds_config.zero_option(cfg) == "ddp" and cfg.adapter.method.value == "none"
    if not label or not fp32_module or not cfg.samples.enabled:
        return []
    why = (f"zero=ddp trains the full {families.of(cfg).module_label} in fp32 weights, which the "
           f"samples run without autocast: {label} takes fp16 or bf16 only (the training step's "
           "autocast does not reach the sampler)")
    return [Problem("train.attention", kernel, why,
                    "train.attention=efficient or sdpa, or zero=stage2 (DeepSpeed holds 16-bit "
                    "weights), or samples.enabled=false")]


def _compile(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """train.compile: what inductor needs to build kernels here, and the layers whose hooks or state torch.compile
    cannot trace (every such layer splits the compiled blocks into pieces that compile again for each shape until
    torch's recompile limit, 8, sends them back to eager: minutes of compiling for no speed)."""
    mode = cfg.train.compile.value
    if mode == "none":
        return []
    out, fix = [], "train.compile=none"
    if ds_config.zero_option(cfg) == "stage3":
        out.append(Problem("train.compile", mode, "ZeRO-3 gathers each submodule's parameters in forward hooks that "
                           "DeepSpeed marks torch.compiler.disable: every layer of a compiled block is a graph break, "
                           "each layer compiles again for every parameter shape until torch's recompile limit sends "
                           "it back to eager (measured on the tiny UNet: 104 compilations, none of the blocks whole)",
                           "zero=fsdp_full_shard (FSDP2 shards like ZeRO-3 and its hooks trace: whole blocks "
                           "compile), or zero=stage2, or " + fix))
    if cfg.quantize.kind.value == "int8":
        out.append(Problem("train.compile", mode, "bitsandbytes' LLM.int8 layers (quantize=int8) keep a matmul state "
                           "object torch.compile does not trace: each int8 layer breaks the compiled block and "
                           "compiles again for every shape until torch's recompile limit sends it back to eager",
                           "quantize=nf4 (its 4-bit layers trace), or " + fix))
    elif cfg.quantize.kind.value == "fp8":
        out.append(Problem(
            "train.compile", mode, "torchao's float8 weights (quantize=fp8) are tensor subclasses, "
            "and torch's AOTAutograd compiles no training graph whose outputs alias one another "
            "when any is a subclass: the first compiled block fails at the first step (measured "
            "with torch 2.13 and torchao 0.18, LoRA, LoKr and LoHa alike)",
            "quantize=nf4 (its 4-bit layers trace), or " + fix))
    elif cfg.quantize.kind.value == "nf4" and ds_config.zero_option(cfg).startswith("fsdp"):
        out.append(Problem("train.compile", mode, "under FSDP2 an NF4 layer's gathered weight is a plain tensor, and "
                           "bitsandbytes wraps it again in its 4-bit parameter at every forward: each such layer "
                           "breaks the compiled block and compiles again for every shape until torch's recompile "
                           "limit sends it back to eager (measured on the tiny UNet: 83 compilations against 4)",
                           "zero=stage2 or zero=ddp with quantize=nf4 (its 4-bit layers trace there), or " + fix))
    if info.kind == "cpu" and not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        out.append(Problem("train.compile", mode, "torch.compile's inductor builds CPU kernels with a C++ compiler, "
                           "and none is on PATH (g++, c++, clang++)", "apt-get install g++, or " + fix))
    if info.kind == "cuda" and importlib.util.find_spec("triton") is None:
        out.append(Problem("train.compile", mode, "torch.compile's inductor writes CUDA kernels in Triton, which is "
                           "not installed", "pip install triton (the version torch's wheel names), or " + fix))
    if info.kind not in ("cpu", "cuda"):
        out.append(Problem("train.compile", mode, f"inductor's kernels are built for CPUs and CUDA GPUs; this run is "
                           f"on {info.kind}", fix))
    return out



def _kahan_kernel(cfg: DictConfig) -> bool:
    """Whether optimi steps with its Triton kernel: DeepSpeed's flat partitions within its reach
    (FSDP2's DTensors and a partition past it take optimi's loop; without Triton, the loop too)."""
    kahan = cfg.resolved.optimizer in optimizers.KAHAN_OPTIMIZERS and not cfg.resolved.kahan_loop
    deepspeed = cfg.zero.backend.value == "deepspeed"
    return kahan and deepspeed and importlib.util.find_spec("triton") is not None


def _triton_tools(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """Triton builds the launcher of its kernels with a C compiler and Python's headers at their
    first use, on CUDA as on the CPU: a runtime-only image fails at the first compiled, Kahan or
    Muon step (DeepSpeed compiles Muon at its first step), after the cache build (review 3's P3)."""
    compiled, muon = cfg.train.compile.value != "none", cfg.resolved.optimizer == "muon"
    if info.kind != "cuda" or not (compiled or muon or _kahan_kernel(cfg)):
        return []
    missing = toolkit.triton_tools_missing()
    if not missing:
        return []
    why = ("Triton builds the launcher of its CUDA kernels at their first use with a C compiler "
           f"and Python's headers, and this machine lacks {' and '.join(missing)}")
    out = []
    if compiled:
        out.append(Problem("train.compile", cfg.train.compile.value, why, "apt-get install gcc "
                           "python3-dev (or set CC), or train.compile=none"))
    if _kahan_kernel(cfg):
        out.append(Problem("precision", "bf16_pure_kahan", why, "apt-get install gcc python3-dev "
                           "(or set CC), or precision=bf16_pure (DeepSpeed's Adam, rounded "
                           "updates), or zero=fsdp_full_shard (optimi's loop)"))
    if muon:
        out.append(Problem("optimizer.name", "muon", why, "apt-get install gcc python3-dev (or "
                           "set CC), or optimizer=adamw"))
    return out
