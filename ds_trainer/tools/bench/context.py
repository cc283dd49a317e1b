"""Context parallelism's memory, measured: what autograd keeps for backward in one training forward
of the tiny Wan on a long clip, per rank, at context 1 and at context 2 (the sequence split over two
ranks), and the loss of that forward (which must not change). Each setting runs in processes of its
own (torchrun for two ranks); ds_trainer's own family, loss and context split do the work.

    python -m ds_trainer.tools.bench.context --out benchmarks/cpu-tiny-context

Writes `<out>/context.csv` and `<out>/context.md`. The saved bytes are counted as the planner counts
them (tools/plan/unet.py's `saved_bytes`: each tensor autograd saves, once, parameters left out), at
the attention kernel the CPU runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# The long clip: 33 frames of 256 x 256 pixels: 9 latent frames of 16 x 16 patches, 2,304 tokens
OVERRIDES = ["model=wan_tiny", "resolution.width=256", "resolution.height=256",
             "data.video.frames=[33]", "precision=fp32", "logger=none"]


def measure(context: int) -> dict[str, float]:
    """In a rank of a torchrun group (or alone): one forward of the tiny Wan's loss on a fixed clip,
    split over `context` ranks; the bytes autograd saved on this rank and the loss."""
    import torch
    import torch.distributed as dist

    from ds_trainer.config import overrides, rundir, schema
    from ds_trainer.train import families
    from ds_trainer.train.backends.mesh import Mesh
    from ds_trainer.train.families import context as split

    torch.manual_seed(0)
    schema.register()
    rundir.register_resolvers()
    cfg = overrides.compose_checked([*OVERRIDES, f"parallel.context={context}",
                                     f"world_size={context}"])
    if context > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if context > 1 else 0
    family = families.of(cfg)
    model = family.load_trained(cfg)
    split.split(model, Mesh(context, rank, context), "ulysses", family.context_plan(model))
    batch, noise, t = _inputs(cfg)
    total, keep = [0], []

    def pack(x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.nn.Parameter):
            total[0] += x.numel() * x.element_size()
            keep.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = family.losses(model, family.schedule(cfg), batch, noise, t, torch.device("cpu"),
                             torch.float32)
    loss.mean().backward()
    return {"context": context, "rank": rank, "saved_mib": total[0] / 2**20,
            "loss": float(loss.mean())}


def _inputs(cfg: Any) -> tuple[dict[str, Any], Any, Any]:
    """A fixed batch of one clip: its latents (16 x 9 x 32 x 32), a caption's states, noise, a
    timestep."""
    import torch

    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 9, 32, 32, generator=g)
    length = int(cfg.model.flow.text_max_length)
    text = torch.randn(1, length, 32, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    return {"latents": latents, "prompt_embeds": text}, noise, torch.tensor([500])


def run(out: Path) -> list[dict[str, float]]:
    """Context 1 on one process, context 2 on two; one row per rank."""
    rows = []
    for context in (1, 2):
        cmd = [sys.executable, "-m", "ds_trainer.tools.bench.context", "--worker", str(context)]
        if context > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(context),
                   "--master_port", str(_free_port()), "-m", "ds_trainer.tools.bench.context",
                   "--worker", str(context)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            raise SystemExit(f"context={context} failed:\n{done.stderr[-3000:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "context.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["context", "rank", "saved_mib", "loss"])
        writer.writeheader()
        writer.writerows(sorted(rows, key=lambda r: (r["context"], r["rank"])))
    (out / "context.md").write_text(_markdown(rows))
    return rows


def _markdown(rows: list[dict[str, float]]) -> str:
    one = max(r["saved_mib"] for r in rows if r["context"] == 1)
    two = max(r["saved_mib"] for r in rows if r["context"] == 2)
    lines = ["| context | rank | saved for backward (MiB) | loss |", "|---|---|---|---|"]
    lines += [f"| {int(r['context'])} | {int(r['rank'])} | {r['saved_mib']:.1f} | {r['loss']:.6f} |"
              for r in sorted(rows, key=lambda r: (r["context"], r["rank"]))]
    lines += ["", f"What a rank saves for backward at context 2 over context 1: {two / one:.2f}."]
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.tools.bench.context",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/cpu-tiny-context"))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker)), flush=True)
        return 0
    for row in run(args.out):
        print(row)
    print((args.out / "context.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
