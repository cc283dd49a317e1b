"""The README's table of full-size models: per GPU, DeepSpeed's own estimator of the model states beside the
planner's model states and its whole training peak (activations at 1024 px, micro batch 1, bf16, gradient
checkpointing on; DeepSpeed's buffers), for each cell a user weighs before renting GPUs.

    python -m ds_trainer.tools.plan.table      # prints the markdown table (tests/test_plan.py checks the README's)

Everything is computed on the meta device from the architecture folders in ds_trainer/assets: no GPU, no download.
"""

from __future__ import annotations

import sys

from ds_trainer.config import overrides, rundir, schema

GIB = 2**30
MODELS = [("sdxl_base", "SDXL UNet"), ("sd35_medium", "SD3.5 Medium"), ("sd35_large", "SD3.5 Large"),
          ("flux_dev", "FLUX.1-dev"), ("flux_kontext_dev", "FLUX.1 Kontext-dev"), ("qwen_image", "Qwen-Image"),
          ("qwen_image_edit", "Qwen-Image-Edit")]
# (label, zero, offload, parameters offloaded too, GPUs)
CELLS = [("ZeRO-2, 8 GPUs", "stage2", "none", False, 8), ("ZeRO-2 + CPU offload, 8 GPUs", "stage2", "cpu", False, 8),
         ("ZeRO-3, 8 GPUs", "stage3", "none", False, 8),
         ("ZeRO-3 + optimizer offload, 8 GPUs", "stage3", "cpu", False, 8),
         ("ZeRO-3 + optimizer and parameter offload, 1 GPU", "stage3", "cpu", True, 1)]


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


def rows() -> list[list[str]]:
    """[model, cell, DeepSpeed's model states, the planner's, the planner's training peak] in GiB."""
    from ds_trainer.tools import plan

    schema.register()
    rundir.register_resolvers()
    out = []
    for model, label in MODELS:
        for cell, zero, offload, params_offload, gpus in CELLS:
            cfg = overrides.compose_checked([f"model={model}", "resolution=px1024", "train.micro_batch_size=1",
                                             "train.gradient_checkpointing=true", f"zero={zero}",
                                             f"offload={offload}", f"offload.params={str(params_offload).lower()}",
                                             f"world_size={gpus}"])
            stats = plan.unet_stats(str(cfg.model.architecture))
            e = plan.estimate(cfg, zero, offload, gpus)
            states = e.params + e.grads + e.optimizer
            ds = _deepspeed(zero, offload, params_offload, gpus, stats.params, stats.largest_layer)
            out.append([f"{label} ({stats.params / 1e9:.2f} B)", cell, f"{ds / GIB:.1f}", f"{states / GIB:.1f}",
                        f"{e.gpu / GIB:.1f}"])
    return out


def markdown() -> str:
    """The README's table, in markdown."""
    head = ["model (trained parameters)", "cell", "DeepSpeed's estimator: model states", "planner: model states",
            "planner: training peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
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
