"""The check's fixed sequence, in priority order: what each step runs and how long it may take.

On a GPU the sequence is split into two parts, one device call each (docs/gpu-check.md): a call
runs its part's steps within `PART_BUDGET_S` (a command of at most ten minutes, less the install,
a step's stop and the transfers), and its part's timeouts sum to at most that budget (a test
holds it). The second call, on the warm machine, first runs what the first left unrun. Flux-dev
runs last, on what is left ("if time remains"). The CPU sequence (`--cpu`) is the same steps with
the tiny models in place of the real sizes, so every step's mechanics run on a CPU machine too.

DeepSpeed's op builds start in the background at launch (`builds.py`); the `ops_*` steps wait for
them, and every step that loads an op comes after its wait: a build that failed or ran out of
time skips those steps with the reason instead of each timing out on the build in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PART_BUDGET_S = {1: 330, 2: 320}
GPU_BUDGET_S = sum(PART_BUDGET_S.values())  # the whole sequence in one call (`--part` left out)
CPU_STEP_S = 90  # a tiny run takes 15-40 s on two busy cores
# DeepSpeed's ops the check builds in the background at launch, by the folder torch's loader
# builds them in, with the builder that builds them (python -m ds_trainer.tools.ops BUILDER).
BUILDERS = {"fused_adam": "FusedAdamBuilder", "cpu_adam": "CPUAdamBuilder",
            "deepspeed_shm_comm": "ShareMemCommBuilder"}  # the last: DeepSpeed's CPU accelerator's


@dataclass(frozen=True)
class Step:
    """One row of the results: `kind` is `probe` (python -m ds_trainer.gpucheck.probes ARGS),
    `cli` (python -m ARGS), `build` (waits for the background build of the op in ARGS) or `train`
    (python -m ds_trainer ARGS in a run folder of its own)."""

    name: str
    group: str  # machine, correctness, real_size, flux
    kind: str
    args: tuple[str, ...]
    timeout_s: int
    what: str
    part: int = 1  # the device call that runs it (`--part`)
    resume_from: str | None = None  # the step whose last checkpoint this run resumes from
    needs: tuple[str, ...] = ()  # modules that must import (else the step is skipped)
    ops: tuple[str, ...] = ()  # DeepSpeed ops the run loads (the GPU machine's: a test holds it)
    real: bool = False  # measured against the planner: MFU and a calibration record
    greedy: bool = False  # may use what is left of the budget
    overrides: dict[str, str] = field(default_factory=dict)
    tagged_images: int = 0  # trains from a folder of this many images with tag captions
    reference_image: bool = False  # samples from a reference picture (an editing model)


BASE = {"logger": "none", "train.export": "false", "train.checkpoint_every": "0",
        "train.final_checkpoint": "false", "data.num_samples": "4", "train.max_steps": "4",
        "scheduler": "constant"}
# Samples, validation and EMA on, as small as they go: one prompt, two sampler steps, two
# held-out images.
EXTRAS = {"samples": "on", "samples.every": "0", "samples.steps": "2",
          "samples.prompts": "[a red cube]", "validation": "on", "validation.split": "2",
          "validation.timesteps": "2", "train.ema": "true", "data.num_samples": "8"}
NO_EMA = {"train.ema": "false", "samples.ema": "false", "validation.ema": "false"}
# The real size: batch 1 at 1024 px with gradient checkpointing; five steps, the median of the
# last three.
REAL = {"resolution": "px1024", "train.micro_batch_size": "1",
        "train.gradient_checkpointing": "true", "data.num_samples": "1", "train.max_steps": "5"}


def loads(step: Step, cpu: bool) -> tuple[str, ...]:
    """The ops `step` loads: the GPU machine's (`step.ops`); on a CPU every DeepSpeed run also loads
    its accelerator's communication op at start-up."""
    deepspeed = step.kind == "train" and step.overrides.get("zero", "stage2").startswith("stage")
    return step.ops + (("deepspeed_shm_comm",) if cpu and deepspeed else ())


def _timeouts(cpu: bool) -> Callable[[int], int]:
    """A step's timeout from its GPU figure: on a CPU every step gets CPU_STEP_S."""
    return (lambda gpu_s: CPU_STEP_S) if cpu else (lambda gpu_s: gpu_s)  # noqa: ARG005


def _train(name: str, group: str, timeout: int, what: str, **kw: object) -> Step:
    overrides = {**BASE, **kw.pop("overrides", {})}  # type: ignore[dict-item]
    args = tuple(f"{k}={v}" for k, v in overrides.items())
    return Step(name, group, "train", args, timeout, what, overrides=overrides,
                **kw)  # type: ignore[arg-type]


def _build(op: str, part: int, timeout: int) -> Step:
    return Step(f"ops_{op}", "machine", "build", (op,), timeout,
                f"DeepSpeed's {BUILDERS[op]} JIT build, started at launch: the build's seconds "
                "(cached for the runs after it)", part=part)


def machine_steps(cpu: bool) -> list[Step]:
    """(a) The machine: GPU, driver, versions, the matrix rate MFU is read against, the doctor."""
    flops = "sdxl_tiny:128" if cpu else "sdxl_base:1024"
    return [
        Step("machine", "machine", "probe", ("machine", "--flops", flops), 45 if not cpu else 60,
             "GPU, driver, torch/CUDA/NCCL versions, bf16 matrix rate, UNet FLOPs per image"),
        Step("doctor", "machine", "cli", ("ds_trainer.doctor",), 10 if not cpu else CPU_STEP_S,
             "python -m ds_trainer.doctor: the pre-flight a user runs"),
    ]


def correctness_steps(cpu: bool) -> list[Step]:
    """(b) Correctness with the tiny models, first what loads no DeepSpeed op (while the builds
    run): backends x precisions x families, samples/validation/EMA, a resume into another layout,
    and the mechanisms of the GPU review's certain findings."""
    t = _timeouts(cpu)
    numel = str(2**16) if cpu else str(2**31 + 4096)
    return [
        Step("mechanisms", "correctness", "probe", ("mechanisms",), t(15),
             "review C2 (CPU tensor on a plain NCCL group), L1 (CPU tensor op with a CUDA "
             "scalar), C3 (FSDP2 offloaded shard: local device vs mesh)"),
        Step("adamw8bit_2g", "correctness", "probe", ("adamw8bit", "--numel", numel), t(15),
             f"review C4: bitsandbytes AdamW8bit on one {numel}-element tensor (int32 sizes)",
             needs=("bitsandbytes",)),
        _train("tiny_ddp", "correctness", t(20), f"SDXL tiny, zero=ddp, {_fp16(cpu)} "
               "(GradScaler), samples+validation+EMA, final checkpoint",
               overrides={"zero": "ddp", "precision": _fp16(cpu), **EXTRAS,
                          "train.final_checkpoint": "true"}),
        _train("tiny_fsdp_cpu_resume", "correctness", t(20), "SDXL tiny, FSDP2 full shard + "
               "offload=cpu, bf16, resumed from tiny_ddp's checkpoint (review C3: the portable "
               "state into another layout)",
               overrides={"zero": "fsdp_full_shard", "offload": "cpu", "train.max_steps": "6"},
               resume_from="tiny_ddp"),
        # FSDP2's samples with the live model (review C1) on the newest family: Qwen-Image-Edit's
        # reference in the latents and in its Qwen2.5-VL encoding; the export's processor read
        # back by transformers' Qwen2VLProcessor (torchvision is there, not on the CPU machine).
        _train("tiny_qwen_edit_fsdp", "correctness", t(20), "Qwen-Image-Edit tiny, FSDP2 full "
               "shard, bf16, samples with the live model (review C1) from a reference picture, "
               "validation, the export's processor read back by Qwen2VLProcessor",
               overrides={"model": "qwen_image_edit_tiny", "zero": "fsdp_full_shard", **EXTRAS,
                          **NO_EMA, "train.export": "true"}, reference_image=True),
        # An fp8 base under DDP: torchao's float8 weights on CUDA (frozen buffers DDP leaves out
        # of its syncs), peft's torchao LoRA layer, a sample.
        _train("tiny_fp8_ddp", "correctness", t(15), "SDXL tiny, zero=ddp, adapter=lora, "
               "quantize=fp8 (torchao), samples",
               overrides={"zero": "ddp", "adapter": "lora", "quantize": "fp8", "samples": "on",
                          "samples.every": "0", "samples.steps": "2",
                          "samples.prompts": "[a red cube]"}, needs=("torchao",)),
        # train.compile on CUDA: inductor's Triton kernels for the UNet's transformer blocks inside
        # FSDP2's units, forward and backward, then a sample's no-grad forward compiled again; the
        # efficient attention kernel. A cold inductor (its worker pool, ~10 graphs) takes minutes.
        _train("tiny_compile_fsdp", "correctness", t(100), "SDXL tiny, zero=fsdp_full_shard, "
               f"train.compile=blocks, train.attention={_kernel(cpu, 'efficient')}, samples",
               overrides={"zero": "fsdp_full_shard", "train.compile": "blocks",
                          "train.attention": _kernel(cpu, "efficient"), **EXTRAS, **NO_EMA}),
    ]


def _fp16(cpu: bool) -> str:
    return "bf16" if cpu else "fp16"  # fp16 needs AVX512-FP16 on a CPU


def _kernel(cpu: bool, gpu: str) -> str:
    return "math" if cpu else gpu  # the CPU has flash and math only


def deepspeed_steps(cpu: bool) -> list[Step]:
    """(b, continued) DeepSpeed with the tiny models, after the wait for FusedAdam's build: fp16's
    loss scaling (SDXL: the flow-matching families are refused fp16 on a GPU), SD3, then part 2's
    client optimizers, levers and offload (after CPU Adam's wait)."""
    t = _timeouts(cpu)
    return [
        _build("fused_adam", 1, t(15)),
        _train("tiny_fp16_zero2", "correctness", t(20), f"SDXL tiny, zero=stage2, {_fp16(cpu)} "
               "(DeepSpeed's loss scaling), samples+validation+EMA",
               overrides={"zero": "stage2", "precision": _fp16(cpu), **EXTRAS},
               ops=("fused_adam",)),
        # The EMA is kept but not sampled from: the step is here for SD3 under DeepSpeed.
        _train("tiny_sd3_zero2", "correctness", t(20), "SD3 tiny, zero=stage2, bf16, "
               "samples+validation with the live weights, EMA kept",
               overrides={"model": "sd3_tiny", "zero": "stage2", **EXTRAS,
                          "samples.ema": "false", "validation.ema": "false"},
               ops=("fused_adam",)),
    ]


def lever_steps(cpu: bool) -> list[Step]:
    """Part 2's tiny steps: DeepSpeed's client optimizers (no op), the levers of issue #48 on the
    GPU paths the CPU never takes, then the ops' steps."""
    t = _timeouts(cpu)
    return [
        # Tag captions, shuffled and dropped: the frozen text encoders stay on the GPU after the
        # cache build and encode every batch's captions; CLIP-bigG's part dropped apart.
        _train("tiny_adamw8bit", "correctness", t(15), "SDXL tiny, zero=stage2, "
               "optimizer=adamw8bit, a folder of tag captions (shuffled and dropped: the text "
               "encoders stay on the GPU), clip_g dropped at 0.3",
               overrides={"zero": "stage2", "optimizer": "adamw8bit", "data.tag_shuffle": "true",
                          "data.keep_tokens": "1", "data.tag_dropout": "0.3",
                          "data.caption_dropout": "0.1",
                          "data.text_encoder_dropout.clip_g": "0.3"},
               needs=("bitsandbytes",), tagged_images=8, part=2),
        # optimi's Triton Kahan AdamW on ZeRO-3's flat bf16 partitions, cuDNN's attention kernel,
        # LoKr's factors registered with their layers under ZeRO-3, and a checkpoint of all three.
        _train("tiny_levers_zero3", "correctness", t(20), "SDXL tiny, zero=stage3, "
               f"precision=bf16_pure_kahan, train.attention={_kernel(cpu, 'cudnn')}, "
               "adapter=lokr, a checkpoint at step 2",
               overrides={"zero": "stage3", "precision": "bf16_pure_kahan",
                          "train.attention": _kernel(cpu, "cudnn"), "adapter": "lokr",
                          "train.checkpoint_every": "2"}, needs=("optimi",), part=2),
        # The video family on CUDA: Wan 2.1 image to video's UMT5 and CLIP vision tower in bf16,
        # the causal 3D VAE encoding clips and the first frame's latents (the input channels of
        # image to video), FSDP2, validation and the export (WanImageToVideoPipeline). No samples:
        # the machine lacks PyAV, whose 34 MiB wheel would not fit beside the carried sets.
        _train("tiny_wan_i2v_fsdp", "correctness", t(20), "Wan 2.1 I2V tiny, FSDP2 full shard, "
               "bf16, synthetic clips of 5 frames, validation, the export",
               overrides={"model": "wan21_i2v_tiny", "zero": "fsdp_full_shard",
                          "data.video.frames": "[5]", "validation": "on", "validation.split": "2",
                          "validation.timesteps": "2", "train.export": "true"}, part=2),
        _build("cpu_adam", 2, t(15)),
        # An NF4 base under ZeRO-3: bitsandbytes' CUDA 4-bit kernels on weights packed in bf16
        # storage, partitioned and gathered by DeepSpeed, then a sample and the LoRA file.
        _train("tiny_nf4_zero3", "correctness", t(20), "SDXL tiny, zero=stage3, adapter=lora, "
               "quantize=nf4 (packed in bf16, partitioned), samples",
               overrides={"zero": "stage3", "adapter": "lora", "quantize": "nf4", **EXTRAS,
                          **NO_EMA}, needs=("bitsandbytes",), ops=("fused_adam",), part=2),
        _train("tiny_flux_zero3_cpu", "correctness", t(25), "Flux tiny, zero=stage3 "
               "offload=cpu, bf16, samples+validation+EMA",
               overrides={"model": "flux_tiny", "zero": "stage3", "offload": "cpu", **EXTRAS},
               ops=("cpu_adam",), part=2),
    ]


def real_size_steps(cpu: bool) -> list[Step]:
    """(c) SDXL's UNet from its config with random weights at 1024 px, batch 1, gradient
    checkpointing (on a CPU: the tiny model at 256 px without checkpointing, so that the planner's
    activations are not 0.00 GiB, three steps): s/it, peak memory, MFU beside the planner's."""
    model = {"model": "sdxl_tiny", "resolution": "px256", "train.gradient_checkpointing": "false",
             "train.max_steps": "3"} if cpu else {"model": "sdxl_base"}
    t = _timeouts(cpu)
    bnb = ("bitsandbytes",)
    # (name, timeout, overrides, what, needs, ops): the cells that load no op first
    cells = [("sdxl_fsdp", 30, {"zero": "fsdp_full_shard"}, "zero=fsdp_full_shard", (), ()),
             # ZeRO-3: under ZeRO-1/2 one rank's flat partition of SDXL is past 2**31 (review C4)
             ("sdxl_adamw8bit", 30, {"zero": "stage3", "optimizer": "adamw8bit"},
              "zero=stage3 optimizer=adamw8bit", bnb, ()),
             ("sdxl_zero2", 30, {"zero": "stage2"}, "zero=stage2", (), ("fused_adam",)),
             ("sdxl_zero3", 30, {"zero": "stage3"}, "zero=stage3", (), ("fused_adam",)),
             # A rank-64 LoRA on an NF4 base: the planner's quantized bytes against the GPU's
             ("sdxl_lora64_nf4", 30, {"zero": "stage2", "adapter": "lora", "adapter.rank": "64",
                                      "adapter.alpha": "64", "quantize": "nf4"},
              "zero=stage2 adapter=lora rank 64 quantize=nf4", bnb, ("fused_adam",)),
             ("sdxl_zero2_cpu", 35, {"zero": "stage2", "offload": "cpu"},
              "zero=stage2 offload=cpu", (), ("cpu_adam",))]
    size = "SDXL tiny 256 px, batch 1" if cpu else "SDXL UNet 1024 px, batch 1, grad ckpt"
    return [_train(name, "real_size", t(timeout), f"{size}, {what}",
                   overrides={**REAL, **model, **cell}, real=True, needs=needs, ops=ops, part=2)
            for name, timeout, cell, what, needs, ops in cells]


def flux_steps(cpu: bool) -> list[Step]:
    """(d) If time remains: Flux-dev's transformer, LoRA under ZeRO-3 + CPU offload at 1024 px."""
    model = {"model": "flux_tiny", "resolution": "px128"} if cpu else {"model": "flux_dev"}
    what = "Flux tiny 128 px" if cpu else "Flux-dev 1024 px"
    return [_train("flux_dev_lora", "flux", CPU_STEP_S if cpu else 15,
                   f"{what}, LoRA, zero=stage3 offload=cpu, batch 1, grad ckpt (runs on what the "
                   "budget has left)",
                   overrides={**REAL, **model, "zero": "stage3", "offload": "cpu",
                              "adapter": "lora"},
                   real=True, greedy=True, ops=("cpu_adam",), part=2)]


def sequence(cpu: bool) -> list[Step]:
    """The whole check, in priority order: part 1's steps, then part 2's."""
    return (machine_steps(cpu) + correctness_steps(cpu) + deepspeed_steps(cpu) + lever_steps(cpu)
            + real_size_steps(cpu) + flux_steps(cpu))
