"""`python -m ds_trainer.bench`: the benchmark's flags, and the program they select: the raw loop (`--raw`, run by
the other programs), `--precisions`, `--startup-pairs`, or the cell matrix."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The package's summary (tools/bench/__init__.py says more).
DESCRIPTION = ("GPU benchmark: the full-size SDXL UNet per ZeRO stage, offload, resolution, micro batch and gradient "
               "checkpointing; peak memory, speed, MFU, and our overhead over a hand-written DeepSpeed loop.")

def build_parser() -> argparse.ArgumentParser:
    """Every flag of every program (they share the model, sizes, steps and output folder)."""
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.bench", description=DESCRIPTION)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/run"))
    parser.add_argument("--model", default="sdxl_base")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cells", choices=("targets", "all"), default="all")
    parser.add_argument("--steps", type=int, default=12, help="steps per cell (half with accumulation); 2 warm up")
    parser.add_argument("--budget-min", type=float, default=None, help="start no cell after this many minutes")
    parser.add_argument("--cell-timeout-s", type=int, default=900)
    parser.add_argument("--nvme-path", default="/tmp/ds_trainer_bench_swap")
    parser.add_argument("--adapter", choices=("none", "lora", "lora_wide"), default="none",
                        help="what every cell trains: the whole UNet, or LoRA (use its own --out)")
    parser.add_argument("--overhead-pairs", type=int, default=1,
                        help="run the overhead cell and the raw loop alternately this many times (median ratio)")
    parser.add_argument("--startup-pairs", type=int, default=0,
                        help="instead of the cells: time to the first step and s/it of each --zeros option against "
                             "the raw loop, this many alternating pairs each (see tools/bench/startup.py)")
    parser.add_argument("--zeros", nargs="+", default=["ddp", "stage2", "stage3"],
                        help="the zero options --startup-pairs measures")
    parser.add_argument("--peer-script", type=Path, default=None,
                        help="with --startup-pairs: the path of diffusers' examples/text_to_image/"
                             "train_text_to_image_sdxl.py, timed in each pair on the same weights, images, batch and "
                             "steps as the run (see tools/bench/peer.py); needs the datasets and torchvision packages "
                             "in --peer-python (datasets comes with ds_trainer; torchvision: the build for your torch)")
    parser.add_argument("--peer-python", default=sys.executable,
                        help="the Python that runs --peer-script (default: this one)")
    parser.add_argument("--precisions", nargs="+", default=None,
                        help="instead of the cells: the training loss of the same run under each of these precisions "
                             "(see tools/bench/precision.py), at each --lrs, for --steps steps")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-4], help="the learning rates --precisions runs at")
    parser.add_argument("--samples", type=int, default=64, help="synthetic images --precisions trains on")
    parser.add_argument("--data-scale", type=int, nargs="+", default=None,
                        help="instead of the cells: the host memory and time of a latent cache build and a training "
                             "run from webdataset shards of this many synthetic images (tools/bench/data_scale.py)")
    parser.add_argument("--data-dir", default="/tmp/ds_trainer_data_scale", help="where --data-scale writes the images")
    parser.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def raw(args: argparse.Namespace) -> int:
    """`--raw <run folder>`: the raw loop of a run's model and DeepSpeed JSON; prints its times for the caller."""
    from ds_trainer.tools.bench.cells import raw_loop

    first, median = raw_loop(args.raw, args.steps)
    print(f"raw_first_step_at={first}\nraw_median_s_per_it={median}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Read the flags and run the program they select."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.peer_script is not None and not args.startup_pairs:
        parser.error("--peer-script is timed beside the runs of --startup-pairs N: add --startup-pairs")
    if args.peer_script is not None and not args.peer_script.is_file():
        parser.error(f"--peer-script {args.peer_script}: no such file")
    if args.raw is not None:
        return raw(args)
    if args.precisions:
        from ds_trainer.tools.bench import precision

        return precision.main(args)
    if args.data_scale:
        from ds_trainer.tools.bench import data_scale

        return data_scale.main(args)
    if args.startup_pairs:
        from ds_trainer.tools.bench import startup

        return startup.main(args)
    from ds_trainer.tools.bench import matrix

    return matrix.run(args)
