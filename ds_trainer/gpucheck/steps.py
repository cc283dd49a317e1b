"""The check's fixed sequence, in priority order: what each step runs and how long it may take.

The GPU sequence's timeouts sum to 500 s (a test holds it): a command of at most ten minutes, less the install and
the transfers (the machine's start is outside it). The last step (Flux-dev) runs only on the time the others left
("if time remains"): its timeout is what is left of the budget, at least its own. The CPU sequence (`--cpu`) is the
same steps with the tiny models in place of the real sizes, so every step's mechanics run on a CPU machine too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

GPU_BUDGET_S = 575
CPU_STEP_S = 90  # a tiny run takes 15-40 s on two busy cores


@dataclass(frozen=True)
class Step:
    """One row of the results: `kind` is `probe` (python -m ds_trainer.gpucheck.probes ARGS), `cli`
    (python -m ARGS) or `train` (python -m ds_trainer ARGS in a run folder of its own)."""

    name: str
    group: str  # machine, correctness, real_size, flux
    kind: str
    args: tuple[str, ...]
    timeout_s: int
    what: str
    resume_from: str | None = None  # the step whose last checkpoint this run resumes from
    needs: tuple[str, ...] = ()  # modules that must import (a wheel set not installed: the step is skipped)
    real: bool = False  # measured against the planner: MFU and a calibration record
    greedy: bool = False  # may use what is left of the budget
    overrides: dict[str, str] = field(default_factory=dict)
    tagged_images: int = 0  # trains from a folder of this many images with tag captions, written on the machine
    reference_image: bool = False  # samples from a reference picture written on the machine (an editing model)


BASE = {"logger": "none", "train.export": "false", "train.checkpoint_every": "0", "train.final_checkpoint": "false",
        "data.num_samples": "4", "train.max_steps": "4", "scheduler": "constant"}
# Samples, validation and EMA on, as small as they go: one prompt, two sampler steps, two held-out images.
EXTRAS = {"samples": "on", "samples.every": "0", "samples.steps": "2", "samples.prompts": "[a red cube]",
          "validation": "on", "validation.split": "2", "validation.timesteps": "2", "train.ema": "true",
          "data.num_samples": "8"}
# The real size: batch 1 at 1024 px with gradient checkpointing; five steps, the median of the last three.
REAL = {"resolution": "px1024", "train.micro_batch_size": "1", "train.gradient_checkpointing": "true",
        "data.num_samples": "1", "train.max_steps": "5"}


def _timeouts(cpu: bool) -> Callable[[int], int]:
    """A step's timeout from its GPU figure: on a CPU every step gets CPU_STEP_S."""
    return (lambda gpu_s: CPU_STEP_S) if cpu else (lambda gpu_s: gpu_s)  # noqa: ARG005


def _train(name: str, group: str, timeout: int, what: str, **kw: object) -> Step:
    overrides = {**BASE, **kw.pop("overrides", {})}  # type: ignore[dict-item]
    args = tuple(f"{k}={v}" for k, v in overrides.items())
    return Step(name, group, "train", args, timeout, what, overrides=overrides, **kw)  # type: ignore[arg-type]


def machine_steps(cpu: bool) -> list[Step]:
    """(a) The machine: GPU, driver, versions, the matrix rate MFU is read against, the doctor, op compile times."""
    flops = "sdxl_tiny:128" if cpu else "sdxl_base:1024"
    return [
        Step("machine", "machine", "probe", ("machine", "--flops", flops), 20 if not cpu else 60,
             "GPU, driver, torch/CUDA/NCCL versions, bf16 matrix rate, UNet FLOPs per image"),
        Step("doctor", "machine", "cli", ("ds_trainer.doctor",), 10 if not cpu else CPU_STEP_S,
             "python -m ds_trainer.doctor: the pre-flight a user runs"),
        Step("ops_fused_adam", "machine", "cli", ("ds_trainer.tools.ops", "FusedAdamBuilder"),
             60 if not cpu else CPU_STEP_S,
             "DeepSpeed's FusedAdam JIT compile (time = compile time; cached for the runs below)"),
        Step("ops_cpu_adam", "machine", "cli", ("ds_trainer.tools.ops", "CPUAdamBuilder"), 40 if not cpu else 180,
             "DeepSpeed's CPU Adam compile (offload=cpu runs load it)"),
    ]


def correctness_steps(cpu: bool) -> list[Step]:
    """(b) Correctness with the tiny models: backends x precisions x families, samples/validation/EMA, a resume
    into another layout, and the mechanisms of the GPU review's certain findings."""
    fp16 = "bf16" if cpu else "fp16"  # fp16 needs AVX512-FP16 on a CPU
    t = _timeouts(cpu)
    numel = str(2**16) if cpu else str(2**31 + 4096)
    return [
        Step("mechanisms", "correctness", "probe", ("mechanisms",), t(15),
             "review C2 (CPU tensor on a plain NCCL group), L1 (CPU tensor op with a CUDA scalar), C3 (FSDP2 "
             "offloaded shard: local device vs mesh)"),
        Step("adamw8bit_2g", "correctness", "probe", ("adamw8bit", "--numel", numel), t(15),
             f"review C4: bitsandbytes AdamW8bit on one {numel}-element tensor (int32 sizes)",
             needs=("bitsandbytes",)),
        _train("tiny_ddp", "correctness", t(20), f"SDXL tiny, zero=ddp, {fp16}, samples+validation+EMA, final "
               "checkpoint", overrides={"zero": "ddp", "precision": fp16, **EXTRAS, "train.final_checkpoint": "true"}),
        # The EMA is kept but not sampled from: SD3's persistent pos_embed buffer stops an EMA sample (review A1,
        # seen on the CPU), and the step is here for fp16 under DeepSpeed, samples and validation.
        _train("tiny_sd3_zero2", "correctness", t(20), f"SD3 tiny, zero=stage2, {fp16}, samples+validation with the "
               "live weights, EMA kept", overrides={"model": "sd3_tiny", "zero": "stage2", "precision": fp16, **EXTRAS,
                                                    "samples.ema": "false", "validation.ema": "false"}),
        _train("tiny_flux_zero3_cpu", "correctness", t(25), "Flux tiny, zero=stage3 offload=cpu, bf16, "
               "samples+validation+EMA",
               overrides={"model": "flux_tiny", "zero": "stage3", "offload": "cpu", **EXTRAS}),
        # FSDP2's samples with the live model (review C1) on the newest family: Qwen-Image-Edit's reference in the
        # latents and in its Qwen2.5-VL encoding; the export's processor read back by transformers' Qwen2VLProcessor
        # (torchvision is there, not on the CPU machine), or the step fails.
        _train("tiny_qwen_edit_fsdp", "correctness", t(20), "Qwen-Image-Edit tiny, FSDP2 full shard, bf16, samples "
               "with the live model (review C1) from a reference picture, validation, the export's processor read "
               "back by Qwen2VLProcessor", overrides={"model": "qwen_image_edit_tiny", "zero": "fsdp_full_shard",
                                                      **EXTRAS, "train.ema": "false", "samples.ema": "false",
                                                      "validation.ema": "false", "train.export": "true"},
               reference_image=True),
        _train("tiny_fsdp_cpu_resume", "correctness", t(20), "SDXL tiny, FSDP2 full shard + offload=cpu, bf16, "
               "resumed from tiny_ddp's checkpoint (review C3: the portable state into another layout)",
               overrides={"zero": "fsdp_full_shard", "offload": "cpu", "train.max_steps": "6"},
               resume_from="tiny_ddp"),
        # A folder of tag captions, tags shuffled and dropped: the frozen text encoders stay on the GPU after the
        # cache build and encode every batch's captions; CLIP-bigG's part dropped apart.
        _train("tiny_adamw8bit", "correctness", t(15), "SDXL tiny, zero=stage2, optimizer=adamw8bit, a folder of tag "
               "captions (shuffled and dropped: the text encoders stay on the GPU), clip_g dropped at 0.3",
               overrides={"zero": "stage2", "optimizer": "adamw8bit", "data.tag_shuffle": "true",
                          "data.keep_tokens": "1", "data.tag_dropout": "0.3", "data.caption_dropout": "0.1",
                          "data.text_encoder_dropout.clip_g": "0.3"},
               needs=("bitsandbytes",), tagged_images=8),
    ]


def lever_steps(cpu: bool) -> list[Step]:
    """(b, continued) The memory and speed levers of issue #48 on the GPU paths the CPU never takes."""
    t = _timeouts(cpu)
    return [
        # Three levers whose GPU paths the CPU never takes: optimi's Triton Kahan AdamW on ZeRO-3's flat bf16
        # partitions, cuDNN's attention kernel (the CPU has flash and math only), LoKr's factors registered with
        # their layers under ZeRO-3 (stop 55), and a checkpoint of all three.
        _train("tiny_levers_zero3", "correctness", t(20), "SDXL tiny, zero=stage3, precision=bf16_pure_kahan, "
               "train.attention=" + ("math" if cpu else "cudnn") + ", adapter=lokr, a checkpoint at step 2",
               overrides={"zero": "stage3", "precision": "bf16_pure_kahan", "train.attention": "math" if cpu else
                          "cudnn", "adapter": "lokr", "train.checkpoint_every": "2"}, needs=("optimi",)),
        # An NF4 base under ZeRO-3: bitsandbytes' CUDA 4-bit kernels on weights packed in bf16 storage, partitioned
        # and gathered by DeepSpeed, then a sample and the LoRA file (the CPU runs bitsandbytes' CPU kernels).
        _train("tiny_nf4_zero3", "correctness", t(20), "SDXL tiny, zero=stage3, adapter=lora, quantize=nf4 (packed "
               "in bf16, partitioned), samples", overrides={"zero": "stage3", "adapter": "lora", "quantize": "nf4",
                                                           **EXTRAS, "train.ema": "false", "samples.ema": "false",
                                                           "validation.ema": "false"}, needs=("bitsandbytes",)),
        # An fp8 base under DDP: torchao's float8 weights on CUDA (frozen buffers DDP leaves out of its syncs), peft's
        # torchao LoRA layer, a sample.
        _train("tiny_fp8_ddp", "correctness", t(15), "SDXL tiny, zero=ddp, adapter=lora, quantize=fp8 (torchao), "
               "samples", overrides={"zero": "ddp", "adapter": "lora", "quantize": "fp8", "samples": "on",
                                     "samples.every": "0", "samples.steps": "2", "samples.prompts": "[a red cube]"},
               needs=("torchao",)),
        # train.compile on CUDA: inductor's Triton kernels for the UNet's transformer blocks inside FSDP2's units,
        # forward and backward, then a sample's no-grad forward compiled again; the efficient attention kernel (the
        # CPU has flash and math only). Its compile seconds are in the row's summary (compile_s), apart from s/it.
        _train("tiny_compile_fsdp", "correctness", t(40), "SDXL tiny, zero=fsdp_full_shard, train.compile=blocks, "
               "train.attention=" + ("math" if cpu else "efficient") + ", samples",
               overrides={"zero": "fsdp_full_shard", "train.compile": "blocks", "train.attention": "math" if cpu else
                          "efficient", **EXTRAS, "train.ema": "false", "samples.ema": "false",
                          "validation.ema": "false"}),
    ]


def real_size_steps(cpu: bool) -> list[Step]:
    """(c) SDXL's UNet from its config with random weights at 1024 px, batch 1, gradient checkpointing (on a CPU:
    the tiny model at 128 px, for the mechanics): s/it, peak memory, MFU beside the planner's figures."""
    # On a CPU: 256 px without checkpointing, so that the planner's activations (logged in GiB to two places)
    # are not 0.00 and the cell gives a calibration line.
    # Three steps: the third is timed.
    model = {"model": "sdxl_tiny", "resolution": "px256", "train.gradient_checkpointing": "false",
             "train.max_steps": "3"} if cpu else {"model": "sdxl_base"}
    t = _timeouts(cpu)
    cells = [("sdxl_zero2", 30, {"zero": "stage2"}, "zero=stage2"),
             ("sdxl_zero2_cpu", 35, {"zero": "stage2", "offload": "cpu"}, "zero=stage2 offload=cpu"),
             ("sdxl_zero3", 30, {"zero": "stage3"}, "zero=stage3"),
             ("sdxl_fsdp", 30, {"zero": "fsdp_full_shard"}, "zero=fsdp_full_shard"),
             # ZeRO-3: under ZeRO-1/2 one rank's flat partition of SDXL is over 2**31 elements (review C4)
             ("sdxl_adamw8bit", 30, {"zero": "stage3", "optimizer": "adamw8bit"}, "zero=stage3 optimizer=adamw8bit"),
             # A rank-64 LoRA on an NF4 base: the planner's quantized bytes against the GPU's (quantize=nf4)
             ("sdxl_lora64_nf4", 30, {"zero": "stage2", "adapter": "lora", "adapter.rank": "64",
                                      "adapter.alpha": "64", "quantize": "nf4"},
              "zero=stage2 adapter=lora rank 64 quantize=nf4")]
    size = "SDXL tiny 256 px, batch 1" if cpu else "SDXL UNet 1024 px, batch 1, grad ckpt"
    return [_train(name, "real_size", t(timeout), f"{size}, {what}",
                   overrides={**REAL, **model, **cell}, real=True,
                   needs=("bitsandbytes",) if "optimizer" in cell or "quantize" in cell else ())
            for name, timeout, cell, what in cells]


def flux_steps(cpu: bool) -> list[Step]:
    """(d) If time remains: Flux-dev's transformer, LoRA under ZeRO-3 + CPU offload at 1024 px."""
    model = {"model": "flux_tiny", "resolution": "px128"} if cpu else {"model": "flux_dev"}
    return [_train("flux_dev_lora", "flux", CPU_STEP_S if cpu else 15,
                   ("Flux tiny 128 px" if cpu else "Flux-dev 1024 px") + ", LoRA, zero=stage3 offload=cpu, batch 1, "
                   "grad ckpt (runs on what the budget has left)",
                   overrides={**REAL, **model, "zero": "stage3", "offload": "cpu", "adapter": "lora"},
                   real=True, greedy=True)]


def sequence(cpu: bool) -> list[Step]:
    """The whole check, in priority order."""
    return (machine_steps(cpu) + correctness_steps(cpu) + lever_steps(cpu) + real_size_steps(cpu)
            + flux_steps(cpu))
