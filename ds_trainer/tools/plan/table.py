"""The README's table of full-size models: per GPU, DeepSpeed's own estimator of the model states
beside the planner's model states and its whole training peak (activations at 1024 px, micro batch
1, bf16, gradient checkpointing on; DeepSpeed's buffers), for each cell a user weighs before renting
GPUs; and the context size (parallel.context) at which ZeRO-3 on eight 80 GiB GPUs holds the row's
sample.

    python -m ds_trainer.tools.plan.table      # prints the markdown table (tests/test_plan.py checks the README's)

Everything is computed on the meta device from the architecture folders in ds_trainer/assets: no GPU, no download.
"""

from __future__ import annotations

import sys

from ds_trainer.config import overrides, rundir, schema

GIB = 2**30
# (model option, label, the size it trains at: overrides)
PX1024 = ("resolution=px1024",)
MODELS = [("sdxl_base", "SDXL UNet", PX1024), ("sd35_medium", "SD3.5 Medium", PX1024),
          ("sd35_large", "SD3.5 Large", PX1024), ("flux_dev", "FLUX.1-dev", PX1024),
          ("flux_kontext_dev", "FLUX.1 Kontext-dev", PX1024), ("qwen_image", "Qwen-Image", PX1024),
          ("qwen_image_edit", "Qwen-Image-Edit", PX1024), ("chroma", "Chroma1-HD", PX1024),
          ("z_image", "Z-Image, Z-Image-Turbo", PX1024),
          ("qwen_image_edit_2511", "Qwen-Image-Edit-2509/2511, 3 references", PX1024),
          ("flux2_dev", "FLUX.2 [dev]", PX1024), ("flux2_klein_4b", "FLUX.2 [klein] 4B", PX1024),
          ("flux2_klein_9b", "FLUX.2 [klein] 9B", PX1024)]
# The video models at 480p and 720p, 81 frames (Wan 2.2 TI2V-5B at its 16x VAE's multiples of 32)
P480 = ("resolution.width=832", "resolution.height=480", "data.video.frames=[81]")
P720 = ("resolution.width=1280", "resolution.height=720", "data.video.frames=[81]")
P704 = ("resolution.width=1280", "resolution.height=704", "data.video.frames=[81]")
VIDEO = [("wan21_t2v_14b", "Wan 2.1 T2V 14B", P480), ("wan21_t2v_14b", "Wan 2.1 T2V 14B", P720),
         ("wan22_t2v_a14b", "Wan 2.2 A14B, one expert", P480),
         ("wan22_t2v_a14b", "Wan 2.2 A14B, one expert", P720),
         ("wan22_ti2v_5b", "Wan 2.2 TI2V-5B", P480), ("wan22_ti2v_5b", "Wan 2.2 TI2V-5B", P704)]
# (label, zero, offload, parameters offloaded too, GPUs)
CELLS = [("ZeRO-2, 8 GPUs", "stage2", "none", False, 8), ("ZeRO-2 + CPU offload, 8 GPUs", "stage2", "cpu", False, 8),
         ("ZeRO-3, 8 GPUs", "stage3", "none", False, 8),
         ("ZeRO-3 + optimizer offload, 8 GPUs", "stage3", "cpu", False, 8),
         ("ZeRO-3 + optimizer and parameter offload, 1 GPU", "stage3", "cpu", True, 1)]
# The last column: the smallest parallel.context at which ZeRO-3 on 8 GPUs of this many GiB fits
CONTEXT_GPU_GIB, CONTEXTS = 80, (1, 2, 4, 8)
Row = tuple[str, list[tuple[float, float, float]], tuple[int, float] | None]


def _deepspeed(zero: str, offload: str, params_offload: bool, gpus: int, params: int, layer: int) -> int:
    """GPU bytes per rank of DeepSpeed's estimator (`estimate_zero{2,3}_model_states_mem_needs`)."""
    if zero == "stage2":
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return int(estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus,
                                                         cpu_offload=offload == "cpu")[1])
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    return int(estimate_zero3_model_states_mem_needs(params, layer, num_gpus_per_node=gpus,
                                                     cpu_offload=offload == "cpu",
                                                     cpu_offload_params=params_offload)[1])


def _size(cfg: object) -> str:
    """What a row trains at: `1024 px`, or a clip's `832x480, 81 frames`."""
    r = cfg.resolution  # type: ignore[attr-defined]
    if cfg.model.get("video") is None:  # type: ignore[attr-defined]
        return f"{int(r.width)} px"
    return f"{int(r.width)}x{int(r.height)}, {max(cfg.data.video.frames)} frames"  # type: ignore[attr-defined]


def _context(size: list[str]) -> tuple[int, float] | None:
    """The smallest context size at which ZeRO-3 on 8 GPUs fits CONTEXT_GPU_GIB (and its peak),
    among the sizes the run's checks pass (heads, tokens); None: none does."""
    from ds_trainer.config import checks
    from ds_trainer.tools import plan

    for context in CONTEXTS:
        cfg = overrides.compose_checked([*size, "zero=stage3", "offload=none", "world_size=8",
                                         f"parallel.context={context}"])
        report = checks.check(cfg)
        if any(p.key.startswith("parallel.") for p in report.problems):
            continue
        peak = plan.estimate(report.cfg, "stage3", "none", 8).gpu / GIB
        if peak <= CONTEXT_GPU_GIB:
            return context, peak
    return None


def rows() -> list[Row]:
    """Per model and size: its label, per cell (DeepSpeed's model states, the planner's, the
    planner's training peak) in GiB, and the context that fits ZeRO-3 on 8 GPUs (`_context`)."""
    from ds_trainer.tools import plan

    schema.register()
    rundir.register_resolvers()
    out = []
    for model, label, size in [*MODELS, *VIDEO]:
        cells = []
        for _, zero, offload, params_offload, gpus in CELLS:
            cfg = overrides.compose_checked([f"model={model}", *size, "train.micro_batch_size=1",
                                             "train.gradient_checkpointing=true", f"zero={zero}",
                                             f"offload={offload}", f"offload.params={str(params_offload).lower()}",
                                             f"world_size={gpus}"])
            stats = plan.unet_stats(str(cfg.model.architecture))
            e = plan.estimate(cfg, zero, offload, gpus)
            ds = _deepspeed(zero, offload, params_offload, gpus, stats.params, stats.largest_layer)
            cells.append((ds / GIB, (e.params + e.grads + e.optimizer) / GIB, e.gpu / GIB))
        fits = _context([f"model={model}", *size, "train.micro_batch_size=1",
                         "train.gradient_checkpointing=true"])
        out.append((f"{label} ({stats.params / 1e9:.2f} B), {_size(cfg)}", cells, fits))
    return out


def markdown(found: list[Row] | None = None) -> str:
    """The README's table, in markdown: per cell the model states (DeepSpeed's estimator's and the
    planner's, which agree: tests/test_plan.py) / the planner's training peak; then the context size
    that fits ZeRO-3 on 8 GPUs of CONTEXT_GPU_GIB (its peak where it splits the sample)."""
    head = ["model (trained parameters), size", *(cell[0] for cell in CELLS),
            f"parallel.context for ZeRO-3 on 8 x {CONTEXT_GPU_GIB} GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, cells, fits in found if found is not None else rows():
        context = "none fits" if fits is None else str(fits[0])
        if fits is not None and fits[0] > 1:
            context += f" ({fits[1]:.1f})"
        figures = [f"{states:.1f} / {peak:.1f}" for _, states, peak in cells]
        lines.append("| " + " | ".join([label, *figures, context]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ds_trainer.tools.plan.table", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
