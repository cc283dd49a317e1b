"""Cross-group rules, checked before anything heavy runs. Torch-free.

`check` collects every problem at once; each names the key, the value, why, and the override that
fixes it. Fallbacks (a substituted optimizer, DDP on a platform without DeepSpeed, the real place
of an NVMe offload below stage 3) are applied to a copy of the config and recorded in `resolved`.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import math
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import (
    adapter_rules,
    buckets,
    ds_config,
    hardware,
    holdout,
    nvme,
    optimizers,
    samples,
    schema,
    toolkit,
    weights_file,
)
from ds_trainer.config.problems import Problem, Report

# Top-level keys that may hold anything (added by launchers and sweeps).
_FREE_FORM = frozenset({"hydra"})


def world_size_of(cfg: DictConfig) -> int:
    """The run's process count: `world_size` if set, else the launcher's WORLD_SIZE, else 1."""
    if cfg.world_size is not None:
        return int(cfg.world_size)
    return int(os.environ.get("WORLD_SIZE", "1"))


def _unknown_keys(cfg: DictConfig, out: list[Problem]) -> None:
    """Keys force-added with `+` that no schema knows: they would be silently ignored."""
    def walk(node: DictConfig, ref: DictConfig, prefix: str) -> None:
        known = list(ref.keys())
        for key in map(str, node.keys()):
            path = prefix + key
            if key not in known:
                if prefix.split(".")[0] not in _FREE_FORM:
                    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
                    hint = f"did you mean {prefix}{close[0]}?" if close else "remove it"
                    out.append(Problem(path, node[key], "is not a ds_trainer setting", hint))
            elif OmegaConf.is_dict(node._get_node(key)) and OmegaConf.is_dict(ref._get_node(key)) \
                    and node[key] is not None and ref[key] is not None:  # an optional mapping left unset
                walk(node[key], ref[key], path + ".")
    walk(cfg, OmegaConf.structured(schema.Config), "")


_FLOATS = ("optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.momentum", "train.gradient_clipping",
           "train.checkpoint_every_minutes",
           "train.ema_decay", "train.noise_offset", "train.min_snr_gamma", "scheduler.warmup_min_lr",
           "scheduler.cos_min_ratio", "scheduler.warmup_min_ratio", "scheduler.min_lr_ratio")


def _numbers(cfg: DictConfig, out: list[Problem]) -> None:
    infinite = [Problem(key, value, "must be a finite number", f"{key}=<a number>") for key in _FLOATS
                if (value := OmegaConf.select(cfg, key)) is not None and not math.isfinite(value)]
    if infinite:
        out.extend(infinite)
        return  # the range checks below assume finite numbers
    t = cfg.train
    for key, low in (("max_steps", 1), ("micro_batch_size", 1), ("gradient_accumulation_steps", 1),
                     ("log_every", 1), ("checkpoints_to_keep", 1), ("checkpoint_every", 0)):
        if t[key] < low:
            out.append(Problem(f"train.{key}", t[key], f"must be at least {low}", f"train.{key}={max(low, 1)}"))
    if t.checkpoint_every_minutes < 0:
        out.append(Problem("train.checkpoint_every_minutes", t.checkpoint_every_minutes,
                           "must be >= 0 (0: no checkpoints by wall time)", "train.checkpoint_every_minutes=30"))
    if t.gradient_clipping < 0:
        out.append(Problem("train.gradient_clipping", t.gradient_clipping, "must be >= 0 (0 turns clipping off)",
                           "train.gradient_clipping=1.0"))
    if not 0.0 < t.ema_decay < 1.0:
        out.append(Problem("train.ema_decay", t.ema_decay, "must lie strictly between 0 and 1",
                           "train.ema_decay=0.9999"))
    if t.ema_device not in ("cpu", "gpu"):
        out.append(Problem("train.ema_device", t.ema_device, "must be cpu or gpu", "train.ema_device=cpu"))
    if t.min_snr_gamma is not None and t.min_snr_gamma <= 0:
        out.append(Problem("train.min_snr_gamma", t.min_snr_gamma, "must be > 0, or null to turn it off",
                           "train.min_snr_gamma=5.0"))
    if cfg.world_size is not None and cfg.world_size < 1:
        out.append(Problem("world_size", cfg.world_size, "must be at least 1", "world_size=1"))
    launched = os.environ.get("WORLD_SIZE")
    if cfg.world_size is not None and launched is not None and int(launched) != cfg.world_size:
        out.append(Problem("world_size", cfg.world_size, f"the launcher started {launched} processes",
                           f"world_size={launched} (or leave it unset)"))
    o = cfg.optimizer
    if o.lr <= 0:
        out.append(Problem("optimizer.lr", o.lr, "must be > 0", "optimizer.lr=1e-4"))
    if o.eps <= 0:
        out.append(Problem("optimizer.eps", o.eps, "must be > 0", "optimizer.eps=1e-8"))
    if o.weight_decay < 0:
        out.append(Problem("optimizer.weight_decay", o.weight_decay, "must be >= 0", "optimizer.weight_decay=0.01"))
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        out.append(Problem("optimizer.betas", list(o.betas), "must be two numbers in [0, 1)",
                           "optimizer.betas=[0.9,0.999]"))
    s = cfg.scheduler
    if s.warmup_steps is not None and not 0 <= s.warmup_steps <= t.max_steps:
        out.append(Problem("scheduler.warmup_steps", s.warmup_steps,
                           f"must lie between 0 and train.max_steps={t.max_steps}",
                           f"scheduler.warmup_steps={max(0, min(s.warmup_steps, t.max_steps))}"))
    for key in ("cos_min_ratio", "warmup_min_ratio", "min_lr_ratio"):
        if not 0.0 <= s[key] <= 1.0:
            out.append(Problem(f"scheduler.{key}", s[key], "must lie between 0 and 1", f"scheduler.{key}=0.1"))


def _resolution(cfg: DictConfig, out: list[Problem]) -> None:
    factor = int(cfg.model.downsample_factor)
    for side in ("width", "height"):
        value = int(cfg.resolution[side])
        if value < factor or value % factor:
            nearest = max(factor, round(value / factor) * factor)
            out.append(Problem(f"resolution.{side}", value,
                               f"{cfg.model.name} needs a positive multiple of {factor} "
                               f"(VAE x UNet downsampling)", f"resolution.{side}={nearest}"))


def _family(cfg: DictConfig, out: list[Problem]) -> None:
    """What a model family trains with: SD3's and Flux's flow matching needs `model.flow`, SDXL's DDPM noise refuses
    it; SDXL's own levers (noise offset, min-SNR, trained text encoders, a replacement VAE, a whole single-file
    checkpoint) on the transformers are refused, their `model.transformer` file is checked; Flux's
    resolution-dependent shift and guidance input are Flux's."""
    family, flow = cfg.model.family.value, cfg.model.flow
    if cfg.model.get("transformer"):
        out.extend(weights_file.transformer_problems(cfg))
    if family == "sdxl":
        if flow is not None:
            out.append(Problem("model.flow", "{...}", "model.family=sdxl trains with DDPM noise (its scheduler's "
                               "epsilon or v-prediction); flow matching is the sd3 and flux families'",
                               "drop the flow block from the model's yaml, or model.family=sd3|flux for those models"))
        return
    if flow is None:
        out.append(Problem("model.flow", None, f"model.family={family} trains by flow matching, which model.flow "
                           "sets (timestep density, shift, loss weighting, T5's tokens)",
                           f"model={'flux' if family == 'flux' else 'sd3'}_tiny shows the block "
                           f"(conf/model/{'flux' if family == 'flux' else 'sd3'}_tiny.yaml); copy it into your model's "
                           "yaml"))
        return
    for key, value, ok, fix in (
            ("shift", flow.shift, flow.shift > 0, "model.flow.shift=3.0 (SD3's), or 1.0 for no shift"),
            ("logit_std", flow.logit_std, flow.logit_std > 0, "model.flow.logit_std=1.0"),
            ("t5_max_length", flow.t5_max_length, 1 <= flow.t5_max_length <= 512,
             "model.flow.t5_max_length=256 (SD3's; T5 takes at most 512)")):
        if not (math.isfinite(value) and ok):
            out.append(Problem(f"model.flow.{key}", value, "out of range", fix))
    if flow.dynamic_shift and family != "flux":
        out.append(Problem("model.flow.dynamic_shift", True, f"the resolution-dependent shift is Flux's; {family}'s "
                           "sampler shifts by the fixed model.flow.shift, and training must match it",
                           "model.flow.dynamic_shift=false"))
    if flow.dynamic_shift and flow.shift != 1.0:
        out.append(Problem("model.flow.shift", flow.shift, "model.flow.dynamic_shift=true shifts each level by the "
                           "image's token count instead; a fixed shift on top would train other levels than Flux's "
                           "sampler uses", "model.flow.shift=1.0"))
    if flow.guidance is not None and family != "flux":
        out.append(Problem("model.flow.guidance", flow.guidance, f"{family}'s transformer has no guidance input "
                           "(Flux.1-dev's distilled guidance)", "model.flow.guidance=null"))
    why_sdxl = f"is SDXL's; model={cfg.model.name} ({family}) "
    if cfg.train.noise_offset:
        out.append(Problem("train.noise_offset", cfg.train.noise_offset, why_sdxl + "trains by flow matching, which "
                           "has no offset noise", "train.noise_offset=0"))
    if cfg.train.min_snr_gamma:
        out.append(Problem("train.min_snr_gamma", cfg.train.min_snr_gamma, why_sdxl + "weighs its loss with "
                           "model.flow.weighting", "train.min_snr_gamma=null (and model.flow.weighting=cosmap or "
                           "sigma_sqrt if you want a weighting)"))
    if cfg.text_encoders.mode.value != "frozen":
        out.append(Problem("text_encoders", cfg.text_encoders.mode.value, why_sdxl + "keeps its CLIP and T5 "
                           "encoders frozen (their outputs cached); training them is not built for this family",
                           "text_encoders=frozen"))
    if cfg.model.vae is not None:
        out.append(Problem("model.vae", cfg.model.vae, why_sdxl + "uses its own VAE (its latent "
                           "scale and shift)",
                           "model.vae=null"))
    if weights_file.is_single_file(cfg.model.pretrained):
        out.append(Problem("model.pretrained", cfg.model.pretrained, f"model={cfg.model.name} loads its VAE and text "
                           "encoders from a diffusers folder or hub id; its transformer alone may come from one file",
                           "model.pretrained=<a diffusers folder or hub id> (stabilityai/stable-diffusion-3.5-medium, "
                           "black-forest-labs/FLUX.1-dev) model.transformer=<the file>"))


def _optimizer(cfg: DictConfig, info: hardware.PlatformInfo, out: list[Problem], warnings: list[str]) -> str | None:
    name, warning = optimizers.resolve(cfg.optimizer.name)
    if warning:
        warnings.append(warning)
    label = optimizers.FACTORED.get(optimizers.normalize(cfg.optimizer.name)) if name is None else None
    if label is not None:
        why = (f"{label} is a factored optimizer (row and column statistics per weight): ZeRO >= 1 hands an "
               "optimizer flat 1-D partitions, where the factorisation is lost (the full second moment comes back) and "
               "per-tensor scaling becomes per-partition, and FSDP splits each weight's rows over the ranks; "
               "ds_trainer does not offer it")
        out.append(Problem("optimizer.name", cfg.optimizer.name, why, "optimizer=adamw8bit (2 bytes a parameter of "
                           "state), or precision=bf16_pure (bf16 Adam state), or offload=cpu"))
        return None
    if name is None:
        known = ", ".join(optimizers.known())
        out.append(Problem("optimizer.name", cfg.optimizer.name, "neither ds_trainer nor the installed DeepSpeed has "
                           f"such an optimizer (known: {known}; the 1-bit optimizers of older docs are gone)",
                           "optimizer=adamw (or optimizer.name=<one of the above>)"))
        return None
    backend = cfg.zero.backend.value
    if optimizers.is_client(name):
        _client_optimizer(cfg, name, info, out, warnings)
        return name
    if backend in ("ddp", "fsdp") and name not in ("adam", "adamw", "adagrad"):
        out.append(Problem("optimizer.name", name, f"zero={ds_config.zero_option(cfg)} runs torch.optim, which has "
                           "adam, adamw and adagrad", "optimizer=adamw, or a DeepSpeed stage such as zero=stage2"))
        return name
    optimizer_on, _ = ds_config.placement(cfg)
    if backend == "deepspeed" and optimizer_on != "gpu" and name not in optimizers.CPU_OFFLOAD_CAPABLE:
        capable = ", ".join(sorted(optimizers.CPU_OFFLOAD_CAPABLE))
        out.append(Problem("optimizer.name", name, f"DeepSpeed has no CPU implementation of {name}, needed to "
                           f"offload its state (it has: {capable})", "optimizer=adamw, or offload=none"))
    if name in optimizers.CUDA_KERNEL and info.kind != "cuda" and (name == "lamb" or optimizer_on == "gpu"):
        fix = "optimizer=adamw" if name == "lamb" else "offload=cpu (DeepSpeed's CPU Lion), or optimizer=adamw"
        out.append(Problem("optimizer.name", name, f"DeepSpeed's fused {name} kernel runs on CUDA only; this machine "
                           f"is {info.kind}", fix))
    if name in optimizers.MUP:
        out.append(Problem("optimizer.name", name, "muP optimizers need mup's set_base_shapes on a width-scaled "
                           "model family; SDXL's UNet is not one", "optimizer=adamw"))
    if name == "muon":
        _muon(cfg, out)
    return name


def _muon(cfg: DictConfig, out: list[Problem]) -> None:
    """DeepSpeed's Muon (0.19.8) on what ds_trainer trains: measured on every stage with the tiny SDXL."""
    if cfg.adapter.method.value == "none":
        out.append(Problem("optimizer.name", "muon", "DeepSpeed's Muon gives every weight of two or more dimensions "
                           "its orthogonalized update, and that update fails on the UNet's 4-D convolution weights "
                           "(a full UNet stops before its first step under every ZeRO stage); LoRA's adapters are "
                           "matrices and train with it", "adapter=lora, or optimizer=adamw"))
    if int(cfg.zero.stage) == 3 and bool(cfg.zero.reduce_scatter):
        out.append(Problem("zero.reduce_scatter", True, "DeepSpeed's ZeRO-3 runs Muon only without reduce-scatter "
                           "(it needs each full gradient to orthogonalize it)", "zero.reduce_scatter=false"))


def _client_optimizer(cfg: DictConfig, name: str, info: hardware.PlatformInfo, out: list[Problem],
                      warnings: list[str]) -> None:
    """An optimizer ds_trainer builds (torch's AdamW, bitsandbytes' AdamW8bit, Prodigy, schedule-free AdamW): it
    runs where its state lives and as its maths needs, or the run is refused; never replaced by another (Accelerate
    would put DeepSpeed's CPU Adam in under offload)."""
    package = optimizers.CLIENT_PACKAGE.get(name)
    if package is not None and importlib.util.find_spec(package[0]) is None:
        out.append(Problem("optimizer.name", name, f"needs the {package[0]} package, which is not installed",
                           f"{package[1]} (the README's setup installs it), or optimizer=adamw"))
    optimizer_on, _ = ds_config.placement(cfg)
    if optimizer_on == "nvme":
        out.append(Problem("offload", "nvme", f"DeepSpeed swaps only its own optimizers' state to NVMe; {name} is "
                           "built by ds_trainer", "offload=cpu, or optimizer=adamw (DeepSpeed's CPU Adam swaps)"))
    if name == "adamw8bit" and cfg.zero.backend.value == "fsdp":
        out.append(Problem("optimizer.name", name, "bitsandbytes' 8-bit state is not built for FSDP2's DTensor "
                           "shards", "zero=stage3 (ZeRO shards it as flat partitions), or optimizer=adamw"))
    if name in optimizers.GLOBAL_STATE:
        _global_state_optimizer(cfg, name, info, out, warnings)


# Schedules that lower the LR over the run: schedule-free's average is what they would buy, and its weighting assumes
# the LR stays at its peak after warm-up.
DECAYING_SCHEDULES = ("warmup_decay", "warmup_cosine", "one_cycle")


def partitioned_over_ranks(cfg: DictConfig) -> bool:
    """Whether each rank's optimizer sees only its partition of the trained parameters (DeepSpeed ZeRO 1-3 on more
    than one rank): what Prodigy's all-reduce of its sums is for."""
    return cfg.zero.backend.value == "deepspeed" and int(cfg.zero.stage) > 0 and world_size_of(cfg) > 1


def _global_state_optimizer(cfg: DictConfig, name: str, info: hardware.PlatformInfo, out: list[Problem],
                            warnings: list[str]) -> None:
    """Prodigy and schedule-free keep state per step, not per element (see `optimizers.GLOBAL_STATE`)."""
    backend, stage, world = cfg.zero.backend.value, int(cfg.zero.stage), world_size_of(cfg)
    if backend == "fsdp":
        out.append(Problem("optimizer.name", name, "ds_trainer reads its state and (schedule-free) computes its "
                           "evaluation weights from ZeRO's partitions or whole torch parameters; FSDP2's DTensor "
                           "shards are not among them", f"zero=stage2 or zero=stage3 with optimizer={name}, or "
                           "optimizer=adamw with FSDP"))
        return
    if name == "prodigy" and partitioned_over_ranks(cfg):
        if info.kind != "cuda":
            out.append(Problem("optimizer.name", name, f"Prodigy's step size d sums over every trained parameter; "
                               f"under ZeRO-{stage} each of the {world} ranks holds only its partition, and "
                               "prodigyopt's all-reduce that joins the sums (fsdp_in_use) runs on CUDA only; this "
                               f"machine is {info.kind}", "zero=stage0 or zero=ddp (every rank holds every "
                               "parameter), one rank, or optimizer=adamw"))
        else:
            warnings.append(f"optimizer=prodigy on {world} ranks under ZeRO-{stage}: prodigyopt's fsdp_in_use path "
                            "all-reduces the sums behind d, so every rank steps with the same d (not run on a GPU by "
                            "ds_trainer's tests)")
    if name == "prodigy" and float(cfg.optimizer.lr) < 0.1:
        warnings.append(f"optimizer=prodigy with optimizer.lr={float(cfg.optimizer.lr):g}: Prodigy's lr multiplies "
                        "the step size it estimates (1.0 takes the estimate as it is), so this trains about "
                        f"{1 / float(cfg.optimizer.lr):.0f} times slower than Prodigy would")
    if name == "schedule_free_adamw" and cfg.scheduler.name.value in DECAYING_SCHEDULES:
        out.append(Problem("scheduler", cfg.scheduler.name.value, "schedule-free AdamW replaces a decaying schedule "
                           "(its averaged weights are what the decay would buy) and weights its average by the peak "
                           "LR, which a decay below it breaks", "scheduler=warmup (warm-up, then constant) or "
                           "scheduler=constant"))
    one_call = 10**12
    if backend == "deepspeed" and stage == 3 and int(cfg.zero.sub_group_size) < one_call:
        warnings.append(f"zero.sub_group_size raised from {int(cfg.zero.sub_group_size)} to {one_call} for "
                        f"optimizer={name}: ZeRO-3 calls step() once per sub-group, and {name}'s per-step state must "
                        "see every trained parameter in one call. DeepSpeed then makes the fp32 gradient of each "
                        "rank's whole partition at once at the step (4 bytes per trained parameter, divided by the "
                        "ranks)")
        cfg.zero.sub_group_size = one_call


def _cuda_ops(cfg: DictConfig, info: hardware.PlatformInfo, optimizer: str | None, out: list[Problem],
              warnings: list[str]) -> None:
    """A GPU-resident DeepSpeed optimizer compiles its fused CUDA kernel at the first step: without a CUDA
    toolkit that matches torch that step fails. Adam and AdamW then run as torch's AdamW (the same update,
    unfused), said loudly and recorded; Lamb and Lion have no such twin and are refused."""
    op = toolkit.CUDA_OPS.get(optimizer or "")
    if info.kind != "cuda" or cfg.zero.backend.value != "deepspeed" or op is None:
        return
    if ds_config.placement(cfg)[0] != "gpu":
        return  # an offloaded state steps in DeepSpeed's C++ CPU op: no nvcc needed
    kit = toolkit.probe()
    if kit.can_compile(op):
        return
    if op == "fused_adam":
        cfg.resolved.torch_adam = True
        warnings.append(f"optimizer={optimizer}: DeepSpeed's FusedAdam cannot be compiled here ({kit.problem}); "
                        f"using torch's AdamW instead (ds_config `torch_adam: true`: the same update, unfused, a "
                        f"little slower; optimizer=adamw_torch chooses torch's AdamW yourself, fused on CUDA). For "
                        f"DeepSpeed's fused kernel: {kit.fix()}")
        return
    fix = kit.fix() + ", or optimizer=adamw" + (" or offload=cpu (DeepSpeed's C++ CPU Lion)" if optimizer == "lion"
                                                  else "")
    out.append(Problem("optimizer.name", optimizer, f"DeepSpeed compiles its fused {optimizer} kernel ({op}) with "
                       f"nvcc at the first step, and cannot here: {kit.problem}", fix))


def _ops(cfg: DictConfig, out: list[Problem]) -> None:
    """Every DeepSpeed op the run loads is built or can be compiled here (a C++ compiler, Python's headers,
    ninja): checked now, before any model loads, rather than minutes in at DeepSpeed's set-up. (nvcc for the
    CUDA ops and libaio are checked above, where the fallback or the offload is decided.)"""
    from ds_trainer.config import op_cache

    folder = op_cache.environment_folder()
    missing = toolkit.build_tools_missing()
    if not missing:
        return
    unbuilt = [op for op in toolkit.needed_ops(cfg) if not toolkit.built(op, folder)]
    if unbuilt:
        out.append(Problem("zero", f"stage{int(cfg.zero.stage)}", f"DeepSpeed's ops {', '.join(unbuilt)} are not "
                           f"built in {folder} and this machine cannot compile them: missing {', '.join(missing)}",
                           toolkit.BUILD_FIX))


# Accelerate's first release with what backend=fsdp relies on: FSDP2 (1.6), trainable parameters cast to one dtype
# before fully_shard (1.14, #3985) and the frozen LoRA base left in its dtype (1.13, #3848).
FSDP_ACCELERATE = (1, 14)
# zero keys only DeepSpeed reads: set under backend=fsdp they would do nothing.
_DEEPSPEED_ONLY = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                   "reduce_bucket_size", "allgather_bucket_size", "round_robin_gradients",
                   "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                   "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "sub_group_size")


def _installed_version(package: str) -> tuple[int, ...] | None:
    from importlib import metadata

    try:
        return tuple(int(part) for part in re.findall(r"\d+", metadata.version(package))[:2])
    except metadata.PackageNotFoundError:
        return None


def _fsdp(cfg: DictConfig, info: hardware.PlatformInfo, out: list[Problem]) -> None:
    """backend=fsdp (zero=fsdp_full_shard / fsdp_shard_grad_op): what PyTorch FSDP2 can do, asked of it."""
    if cfg.zero.backend.value != "fsdp":
        return
    option = ds_config.zero_option(cfg)
    stage = int(cfg.zero.stage)
    if stage not in (2, 3):
        out.append(Problem("zero.stage", stage, "FSDP shards gradients and optimizer state always, and parameters "
                           "between forward and backward with stage 3 (full shard) or not with stage 2 (shard grad "
                           "op); it has no stage 0 or 1", "zero=fsdp_full_shard or zero=fsdp_shard_grad_op"))
    version = _installed_version("accelerate")
    if version is not None and version < FSDP_ACCELERATE:
        out.append(Problem("zero", option, f"the installed accelerate {'.'.join(map(str, version))} predates what "
                           "FSDP2 training of a UNet needs (one dtype for the trainable parameters, a frozen LoRA "
                           "base left in 16 bits)", "pip install -c constraints.txt 'accelerate>=1.14'"))
    if info.kind not in ("cuda", "rocm", "cpu"):
        out.append(Problem("zero", option, f"PyTorch FSDP2 runs on CUDA/ROCm (NCCL) or the CPU (gloo), not {info.kind}",
                           "zero=ddp"))
    device = cfg.offload.device.value
    if device == "nvme":
        out.append(Problem("offload", "nvme", "FSDP offloads to host memory only (CPUOffloadPolicy); it has no NVMe "
                           "tier", "offload=cpu, or zero=stage3 offload=nvme (DeepSpeed swaps to disk)"))
    elif device == "cpu" and cfg.offload.params is False:
        out.append(Problem("offload.params", False, "FSDP's CPU offload is all or nothing: parameters, gradients and "
                           "the optimizer step live on the host together", "offload.params=null, or zero=stage2 "
                           "offload=cpu (DeepSpeed offloads the optimizer state alone)"))
    if cfg.precision.name.value == "fp16":
        out.append(Problem("precision", "fp16", "ds_trainer's FSDP backend trains in bf16 or fp32: fp16 needs a "
                           "gradient scaler over sharded gradients, which it does not run",
                           "precision=bf16, or zero=stage2 precision=fp16 (DeepSpeed's loss scaling)"))
    if str(cfg.zero.fsdp_reduce_dtype) not in ("fp32", "bf16"):
        out.append(Problem("zero.fsdp_reduce_dtype", cfg.zero.fsdp_reduce_dtype, "gradients are reduced in fp32 or "
                           "bf16", "zero.fsdp_reduce_dtype=fp32"))
    if not list(cfg.zero.fsdp_wrap):
        out.append(Problem("zero.fsdp_wrap", [], "with no unit below the root FSDP gathers the whole UNet at once "
                           "(no memory saved over DDP)", f"zero.fsdp_wrap=[{','.join(cfg.model.blocks)}] (the model's "
                           "blocks, the default)"))
    defaults = schema.ZeroConfig()
    for key in _DEEPSPEED_ONLY:
        if cfg.zero[key] != getattr(defaults, key):
            out.append(Problem(f"zero.{key}", cfg.zero[key], f"a DeepSpeed setting; zero={option} is PyTorch FSDP, "
                               "which does not read it", f"drop zero.{key}, or a DeepSpeed stage such as zero=stage"
                               f"{stage if stage in (2, 3) else 3}"))


# Optimizers whose state precision=bf16_pure keeps in bf16 (DeepSpeed's Adam family, its CPU Adam with
# fp32_optimizer_states=False under offload; torch's AdamW on bf16 parameters under FSDP).
PURE_OPTIMIZERS = ("adam", "adamw")


def precision_meaning(cfg: DictConfig) -> dict[str, str]:
    """What `precision` means under the backend that runs, as `config.yaml` records it (resolved.precision): the
    dtypes of the master weights, the gradients the optimizer reads, the optimizer state, the forward/backward
    compute and the gradient reduction."""
    precision, backend = cfg.precision.name.value, cfg.zero.backend.value
    compute = {"bf16": "bf16", "bf16_pure": "bf16", "fp16": "fp16"}.get(precision, "fp32")
    if precision == "bf16_pure":  # DeepSpeed's bf16 masters, gradients, moments; FSDP's bf16 parameters
        master = gradients = state = "bf16"
    else:  # fp32 masters (DeepSpeed's, Accelerate's fp32 FSDP shards, DDP's fp32 module under autocast)
        master = state = gradients = "fp32"
    if backend == "deepspeed":  # DeepSpeed's communication_data_type left unset: the parameters' dtype
        reduce = compute
    elif backend == "fsdp":
        reduce = "fp32" if compute == "fp32" else str(cfg.zero.fsdp_reduce_dtype)
    else:
        reduce = "fp32"
    sharded = ", sharded" if backend == "fsdp" or (backend == "deepspeed" and int(cfg.zero.stage) > 0) else ""
    return {"master_weights": master + sharded, "gradients": gradients, "optimizer_state": state + sharded,
            "compute_dtype": compute, "reduce_dtype": reduce}


def _pure(cfg: DictConfig, out: list[Problem], warnings: list[str]) -> None:
    """precision=bf16_pure: where bf16 masters and optimizer state exist, and what it costs at the run's LR."""
    if cfg.precision.name.value != "bf16_pure":
        return
    lr = float(cfg.optimizer.lr)
    # bf16 keeps 8 significant bits: round to nearest drops an update below half a unit in the last place (2^-9
    # of the weight, taken as 1/256 to allow for Adam's steps reaching a few lr). benchmarks/cpu-tiny-precision.
    warnings.append(f"precision=bf16_pure: the weights are bf16, so an update smaller than about 1/256 of a weight "
                    f"rounds away; Adam steps by about optimizer.lr={lr:g}, which vanishes on every weight larger than "
                    f"~{256 * lr:.2g}. Measured on the tiny model: at lr 1e-5 the loss barely moved (bf16 fell from "
                    "1.07 to 0.61 over the same 400 steps). precision=bf16 keeps fp32 masters")
    backend, stage, option = cfg.zero.backend.value, int(cfg.zero.stage), ds_config.zero_option(cfg)
    if backend == "ddp" or (backend == "deepspeed" and stage == 0):
        out.append(Problem("precision", "bf16_pure", f"bf16 master weights and optimizer state are DeepSpeed's ZeRO "
                           f"1-3 feature (bf16_master_weights_and_grads) or FSDP's bf16 parameters; zero={option} "
                           "keeps fp32 masters", "zero=stage1 (or stage2, stage3, fsdp_full_shard), or precision=bf16"))
        return
    name, _ = optimizers.resolve(cfg.optimizer.name)
    if name is not None and name not in PURE_OPTIMIZERS:
        out.append(Problem("optimizer.name", name, f"precision=bf16_pure keeps Adam's moments in bf16 "
                           f"(bf16_optimizer_states); {name}'s state has no bf16 form in DeepSpeed (under offload its "
                           "CPU kernel stores fp32)", "optimizer=adamw, or precision=bf16"))
    if backend == "deepspeed" and ds_config.placement(cfg)[0] == "nvme":
        out.append(Problem("offload", "nvme", "DeepSpeed's NVMe swapper sizes every optimizer state as fp32; "
                           "precision=bf16_pure keeps it in bf16", "offload=cpu, or precision=bf16"))


def _encoder_units(cfg: DictConfig) -> list[str]:
    """With trained text encoders (text_encoders=lora|full) each encoder layer is an FSDP unit too. The encoders'
    embeddings, final norms and projection stay in the root unit with the UNet's parts outside its blocks (an encoder
    model made a unit would change class, and transformers 5 finds its hidden-state recorders by class)."""
    return ["CLIPEncoderLayer"] if schema.trains_text_encoders(cfg) else []


def fsdp_meaning(cfg: DictConfig) -> dict[str, object]:
    """What backend=fsdp runs, as `config.yaml` records it: the FSDP2 fields and what the precision means."""
    meaning = precision_meaning(cfg)
    return {"fsdp_version": 2, "reshard_after_forward": int(cfg.zero.stage) == 3,
            "units": [str(name) for name in cfg.zero.fsdp_wrap] + _encoder_units(cfg),
            # precision=bf16: Accelerate casts the trainable parameters to fp32 before sharding: fp32 sharded masters
            # and Adam state (DeepSpeed's meaning of the same precision), compute in bf16. bf16_pure: the parameters
            # stay bf16 (mixed_precision "no"), and Adam's state is bf16 with them.
            "master_weights": meaning["master_weights"], "optimizer_state": meaning["optimizer_state"],
            "compute_dtype": meaning["compute_dtype"], "reduce_dtype": meaning["reduce_dtype"],
            "offload": "CPUOffloadPolicy (parameters, gradients, optimizer step on the host)"
            if cfg.offload.device.value == "cpu" else "none",
            # Every micro-batch's gradients are reduce-scattered: no full unsharded gradient kept between them.
            "sync_each_batch": True}


def _offload(cfg: DictConfig, out: list[Problem], warnings: list[str]) -> None:
    device, backend, stage = cfg.offload.device.value, cfg.zero.backend.value, int(cfg.zero.stage)
    if backend == "fsdp":
        return  # its own rules (`_fsdp`)
    if backend == "deepspeed" and stage not in (0, 1, 2, 3):
        out.append(Problem("zero.stage", stage, "ZeRO stages are 0, 1, 2 and 3", "zero=stage2"))
        return
    if device != "none" and (backend == "ddp" or stage == 0):
        which = "zero=ddp" if backend == "ddp" else "zero=stage0"
        out.append(Problem("offload", device, f"{which} has nothing to offload: offload is a ZeRO stage 1-3 feature",
                           f"zero=stage2 offload={device} (or offload=none)"))
        return
    if cfg.offload.params is True and device != "none" and stage != 3:
        out.append(Problem("offload.params", True, f"parameter offload needs zero=stage3 (got zero=stage{stage})",
                           "zero=stage3, or offload.params=false"))
    if device == "nvme" and stage in (1, 2):
        warnings.append(f"offload=nvme with zero=stage{stage}: DeepSpeed swaps to disk only on stage 3; below it "
                        "the optimizer state stays in host memory. Running as offload=cpu (nothing is written "
                        "to offload.nvme_path). For real NVMe swap use zero=stage3.")


def swap_need(cfg: DictConfig, optimizer: str | None = None) -> int:
    """Estimated bytes DeepSpeed writes to offload.nvme_path for this config, before the margin."""
    _, params_on = ds_config.placement(cfg)
    param_bytes = 4 if cfg.precision.name.value == "fp32" else 2
    return nvme.swap_bytes(int(cfg.model.param_count), optimizer or str(cfg.resolved.optimizer or "adamw"),
                           params_on == "nvme", param_bytes)


def swap_problem(cfg: DictConfig, optimizer: str | None = None) -> str | None:
    """Why offload.nvme_path cannot take the swap (estimate x offload.free_space_margin), or None."""
    need = swap_need(cfg, optimizer)
    return nvme.check_path(str(cfg.offload.nvme_path), int(need * float(cfg.offload.free_space_margin)))


def _nvme(cfg: DictConfig, optimizer: str | None, out: list[Problem], gpu: bool = False) -> int:
    optimizer_on, params_on = ds_config.placement(cfg)
    if "nvme" not in (optimizer_on, params_on):
        return 0
    path = str(cfg.offload.nvme_path)
    need = swap_need(cfg, optimizer or "adamw")
    margin = float(cfg.offload.free_space_margin)
    if margin < 1.0:
        out.append(Problem("offload.free_space_margin", margin, "below 1.0 the swap may not fit; DeepSpeed does not "
                           "notice a full swap disk and later aborts the process on reading a short file",
                           "offload.free_space_margin=1.2 (the default)"))
        return need
    why = swap_problem(cfg, optimizer or "adamw")
    if why:
        out.append(Problem("offload.nvme_path", path, why, "offload.nvme_path=<a writable folder on a fast disk>"))
    why = nvme.aio_prerequisites(gpu)
    if why:
        fix = "the CUDA toolkit (CUDA_HOME), or offload=cpu" if "CUDA" in why else "apt-get install libaio-dev, " \
            "or offload=cpu"
        out.append(Problem("offload", "nvme", why, fix))
    return need


def _platform(cfg: DictConfig, info: hardware.PlatformInfo, out: list[Problem], warnings: list[str]) -> None:
    if cfg.zero.backend.value == "deepspeed" and not info.deepspeed:
        warnings.append(f"DeepSpeed does not run on {info.kind}: falling back to zero=ddp"
                        + (f" and dropping offload={cfg.offload.device.value}" if cfg.offload.device.value != "none"
                           else ""))
        cfg.zero.backend, cfg.zero.stage, cfg.offload.device = "ddp", 0, "none"
    precision = cfg.precision.name.value
    if precision in ("bf16", "bf16_pure") and not info.bf16:
        out.append(Problem("precision", precision, f"this {info.gpu_name or info.kind} has no bf16 support",
                           "precision=fp16"))
    if precision == "fp16" and not info.fp16:
        out.append(Problem("precision", "fp16", f"{info.kind} has no fp16 kernels here (DeepSpeed's CPU accelerator "
                           "needs AVX512-FP16 or AMX-FP16)", "precision=bf16 (or precision=fp32)"))


def _paths(cfg: DictConfig, out: list[Problem]) -> None:
    if cfg.data.source.value == "folder":
        if OmegaConf.is_missing(cfg.data, "path") or not cfg.data.path:
            out.append(Problem("data.path", "???", "data=folder reads images from a folder",
                               "data.path=/path/to/images"))
        elif not Path(cfg.data.path).is_dir():
            out.append(Problem("data.path", cfg.data.path, "is not a folder", "data.path=/path/to/images"))
    pretrained = cfg.model.pretrained
    if weights_file.is_single_file(pretrained) and not Path(pretrained).exists():
        out.append(Problem("model.pretrained", pretrained, "no such checkpoint file",
                           "model.pretrained=/path/to/sd_xl_base_1.0.safetensors"))
    elif pretrained and not Path(pretrained).exists() and not re.fullmatch(r"[\w.-]+/[\w.-]+", pretrained):
        out.append(Problem("model.pretrained", pretrained, "is neither a local folder nor a hub id (org/name)",
                           "model.pretrained=/path/to/diffusers/folder (or stabilityai/stable-diffusion-xl-base-1.0)"))
    out.extend(weights_file.problems(cfg))
    resume = cfg.resume
    if resume not in (None, "latest") and not Path(resume).is_dir():
        out.append(Problem("resume", resume, "is neither `latest` nor a checkpoint folder",
                           "resume=latest (or resume=<run dir>/checkpoints/step_N)"))


def check(cfg: DictConfig, info: hardware.PlatformInfo | None = None) -> Report:
    """Validate `cfg` as a whole; the report holds a resolved copy, warnings and all problems."""
    cfg = copy.deepcopy(cfg)
    # Absolute paths: ds_config.json and accelerate_config.yaml must work from any directory.
    cfg.paths.outputs = os.path.abspath(cfg.paths.outputs)
    OmegaConf.resolve(cfg)
    cfg.offload.nvme_path = os.path.abspath(cfg.offload.nvme_path)
    info = info or hardware.detect(cfg.platform.value)
    problems: list[Problem] = []
    warnings: list[str] = []
    _unknown_keys(cfg, problems)
    _numbers(cfg, problems)
    _resolution(cfg, problems)
    _family(cfg, problems)
    problems.extend(buckets.problems(cfg))
    _platform(cfg, info, problems, warnings)
    _offload(cfg, problems, warnings)
    _fsdp(cfg, info, problems)
    _pure(cfg, problems, warnings)
    optimizer = _optimizer(cfg, info, problems, warnings)
    _cuda_ops(cfg, info, optimizer, problems, warnings)
    swap = _nvme(cfg, optimizer, problems, info.kind == "cuda") if not problems else 0
    _paths(cfg, problems)
    problems.extend(adapter_rules.problems(cfg))
    problems.extend(samples.problems(cfg))
    problems.extend(holdout.problems(cfg))
    optimizer_on, params_on = ds_config.placement(cfg)
    cfg.resolved.platform = info.kind
    cfg.resolved.backend = cfg.zero.backend.value
    cfg.resolved.world_size = world_size_of(cfg)
    cfg.resolved.optimizer = optimizer
    cfg.resolved.optimizer_state_on = optimizer_on
    cfg.resolved.params_on = params_on
    cfg.resolved.nvme_swap_bytes = swap
    cfg.resolved.precision = precision_meaning(cfg)
    cfg.resolved.fsdp = fsdp_meaning(cfg) if cfg.zero.backend.value == "fsdp" else None
    cfg.resolved.warnings = warnings
    if not problems:
        _ops(cfg, problems)
    return Report(cfg, problems, warnings)
