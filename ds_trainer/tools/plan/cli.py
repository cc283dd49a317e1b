"""`python -m ds_trainer.plan [overrides]`: before a run, which ZeRO stage and offload fit, per rank.

Takes the same overrides as training (e.g. `resolution=px1024 train.micro_batch_size=8
plan.vram_gib=24`); prints every zero x offload cell's peak GPU memory, host RAM and NVMe bytes,
marks what fits and recommends the cheapest cell that does (docs/planner.md)."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from ds_trainer.config import buckets
from ds_trainer.tools.plan import lora
from ds_trainer.tools.plan.advice import recommend, table
from ds_trainer.tools.plan.cells import GIB, plan
from ds_trainer.tools.plan.states import architecture


def main(argv: list[str] | None = None) -> int:
    """Compose the overrides like training does, print the table and the recommendation."""
    from ds_trainer.config import hardware, overrides, rundir, schema
    from ds_trainer.config.checks import resolve
    from ds_trainer.tools.plan import calibration

    schema.register()
    rundir.register_resolvers()
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = overrides.compose_checked(args, __doc__)  # a mistake: exit 2
    info = hardware.detect(cfg.platform.value)
    if info.kind == "cuda" and cfg.plan.vram_gib is None:
        info = hardware.confirm_with_torch(info)  # torch's figure: a MIG slice's memory, not the whole card's
    world = resolve.world_size_of(cfg)
    budget_gib = cfg.plan.vram_gib if cfg.plan.vram_gib is not None else (
        info.gpu_memory_mib / 1024 * (1 - float(cfg.plan.margin)) if info.gpu_memory_mib else None)
    budget = budget_gib * GIB if budget_gib is not None else None
    calibrated = calibration.for_config(cfg, info)
    estimates = plan(cfg, world, calibrated.factor)
    size = buckets.name(buckets.largest(cfg)) + (" (largest bucket)" if buckets.enabled(cfg) else "")
    print(f"ds_trainer plan: {cfg.model.name} {size}, micro batch "
          f"{cfg.train.micro_batch_size}, {cfg.precision.name.value}, gradient checkpointing "
          f"{'on' if cfg.train.gradient_checkpointing else 'off'}, {world} rank(s); GiB per rank")
    _phases(cfg)
    frozen, trained = lora.encoders(cfg, architecture(cfg))
    if frozen + trained:  # the trained module is the UNet and the encoders
        act = lora.encoder_activations(cfg, architecture(cfg), 4 if cfg.precision.name.value == "fp32" else 2)
        print(f"text_encoders={cfg.text_encoders.mode.value} ({cfg.text_encoders.which.value}): {trained / 1e6:,.1f}M "
              f"encoder parameters train with the UNet, {frozen / 1e6:,.1f}M frozen in the same module; their "
              f"activations {act / 2**20:,.0f} MiB a step (in the activations column)")
    _quantized(cfg)
    print(table(estimates, budget))
    print(calibrated.describe())
    if estimates[0].sampling is not None:
        print("samples/validation=on, GiB per rank while sampling or validating: " + ", ".join(
            f"{e.zero}/{e.offload} {(e.sampling or 0) / GIB:.2f}"
            + (" (does not fit)" if budget is not None and (e.sampling or 0) > budget >= e.gpu else "")
            for e in estimates))
    if budget is None:
        print("no GPU detected: pass plan.vram_gib=<GiB per GPU> to see what fits")
        return 0
    best = recommend(estimates, budget)
    if best is None and any(e.gpu <= budget for e in estimates):
        print(f"training fits {budget_gib:.0f} GiB but sampling or validating fits in no cell: samples.ema=false "
              "or validation.ema=false, smaller samples.width/height or validation.batch_size, or samples=none")
        return 1
    if best is None:
        print(f"nothing fits {budget_gib:.0f} GiB: lower train.micro_batch_size or the resolution, or turn on "
              "train.gradient_checkpointing=true")
        return 1
    print(f"recommended for {budget_gib:.0f} GiB: zero={best.zero} offload={best.offload} "
          f"(about {best.gpu / GIB:.1f} GiB per rank)")
    return 0


def _phases(cfg: DictConfig) -> None:
    """The header's line of a run in phases (config/phases.py): their peaks do not add up."""
    from ds_trainer.config import families, phases

    phased = phases.of(cfg)
    if phased:
        print(f"{len(phased)} phases, one after the other ({', '.join(p.name for p in phased)}): "
              f"each trains one {families.of(cfg).module_label} of this size, freed before the "
              "next starts: the peak per rank is one phase's (below), not their sum")


def _quantized(cfg: DictConfig) -> None:
    """The header's line of a quantized base: where its weights are, which cells are left out."""
    kind = cfg.quantize.kind.value
    if kind != "none":
        held = {"nf4": "; every cell holds its packed weights (ZeRO-3 and FSDP2 in the compute dtype)",
                "int8": "; ZeRO-3 and FSDP2 cells left out (they cannot hold LLM.int8's int8 weights with "
                        "their row scales: refused)",
                "fp8": "; ZeRO-3 and FSDP2 cells left out (they cannot slice torchao's float8 tensors: "
                       "refused)"}[kind]
        encoders = "; the frozen text encoders' too where they stay on the GPU"
        print(f"quantize={kind}: the frozen base's linear layers quantized (in the params column"
              + (encoders if cfg.quantize.text_encoders else "") + held + ")")
