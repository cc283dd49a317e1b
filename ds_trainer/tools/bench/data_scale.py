"""`python -m ds_trainer.bench --data-scale 10000 100000`: what a dataset's size costs the host, measured.

For each size N: N small synthetic images (a coloured shape on a coloured ground, `--resolutions`' first side,
PNG) written as webdataset tar shards of 1,000, then two processes: `python -m ds_trainer.cache` (the images
checked, the latent cache built) and `python -m ds_trainer` training `--steps` steps from that cache (`--model`,
ZeRO as `--zeros`' first option, micro batch `--batches`' first). Each process's peak resident memory is the
kernel's (`wait4`'s ru_maxrss of the child), its wall time measured here. Results: `<out>/data-scale.csv` and
`<out>/data-scale.md`; the images go to `--data-dir` (kept for a rerun; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PER_SHARD = 1000
_COLORS = ((220, 40, 40), (40, 180, 60), (40, 80, 220), (230, 210, 40), (140, 60, 190), (240, 140, 30))
_NAMES = ("red", "green", "blue", "yellow", "purple", "orange")


def write_shards(folder: Path, n: int, side: int) -> str:
    """`n` images in tar shards under `folder` (skipped when they are there); the brace pattern of their paths."""
    from PIL import Image

    shards = (n + PER_SHARD - 1) // PER_SHARD
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        path = folder / f"shard-{shard:05d}.tar"
        if path.exists():
            continue
        tmp = path.with_suffix(".tmp")
        with tarfile.open(tmp, "w") as tar:
            for i in range(shard * PER_SHARD, min(n, (shard + 1) * PER_SHARD)):
                rng = random.Random(i)
                bg, fg = rng.sample(range(len(_COLORS)), 2)
                image = Image.new("RGB", (side, side), _COLORS[bg])
                x, y = rng.randrange(side // 2), rng.randrange(side // 2)
                image.paste(_COLORS[fg], (x, y, x + side // 2, y + side // 2))
                data = io.BytesIO()
                image.save(data, format="PNG")
                for name, payload in ((f"{i:08d}.png", data.getvalue()),
                                      (f"{i:08d}.txt", f"{_NAMES[fg]} square, {_NAMES[bg]} ground, {i}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        tmp.replace(path)
    return str(folder / f"shard-{{00000..{shards - 1:05d}}}.tar")


def measured(cmd: list[str], log: Path) -> tuple[int, float, float]:
    """(exit status, wall seconds, peak RSS in MiB) of `cmd`, its output in `log`."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.monotonic() - start, usage.ru_maxrss / 1024


def one(n: int, args: argparse.Namespace, out: Path) -> dict[str, object]:
    """The cache build and the training run of `n` images: their times and peak RSS."""
    side = args.resolutions[0]
    pattern = write_shards(Path(args.data_dir) / f"n{n}-{side}px", n, side)
    work = out / "runs" / f"n{n}"
    common = [f"model={args.model}", "data=sources", f"data.sources=[{{path: '{pattern}'}}]",
              f"resolution.width={side}", f"resolution.height={side}", f"zero={args.zeros[0]}", "logger=none",
              f"train.micro_batch_size={args.batches[0]}", f"paths.outputs={work / 'outputs'}"]
    work.mkdir(parents=True, exist_ok=True)
    row: dict[str, object] = {"images": n, "shards": (n + PER_SHARD - 1) // PER_SHARD}
    for phase, module, extra in (("cache", "ds_trainer.cache", []),
                                 ("train", "ds_trainer", [f"train.max_steps={args.steps}", "train.export=false",
                                                          "train.final_checkpoint=false"])):
        folder = work / phase
        code, wall, rss = measured([sys.executable, "-m", module, *common, *extra, f"hydra.run.dir={folder}"],
                                   work / f"{phase}.log")
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
        row |= {f"{phase}_status": summary.get("status", f"exit {code}"), f"{phase}_s": round(wall, 1),
                f"{phase}_rss_peak_mib": round(rss)}
        if phase == "cache" and "cache" in summary:
            row |= {"cache_images": summary["cache"]["files"], "cache_packs": summary["cache"].get("packs", "?"),
                    "cache_mib": round(summary["cache"]["bytes"] / 2**20)}
        print(f"{n} images, {phase}: {row[f'{phase}_status']} in {wall:.0f} s, peak RSS {rss:.0f} MiB", flush=True)
    return row


def table(rows: list[dict[str, object]], command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| images | shards | cache build | its peak RSS | cache on disk | training | its peak RSS |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['images']:,} | {r['shards']} | {r['cache_status']}, {r['cache_s']} s | "
                     f"{r['cache_rss_peak_mib']} MiB | {r.get('cache_images', '?')} images in "
                     f"{r.get('cache_packs', '?')} packs, {r.get('cache_mib', '?')} MiB"
                     f" | {r['train_status']}, {r['train_s']} s | {r['train_rss_peak_mib']} MiB |")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        extra = int(b["images"]) - int(a["images"])  # type: ignore[call-overload]
        for phase in ("cache", "train"):
            grown = float(b[f"{phase}_rss_peak_mib"]) - float(a[f"{phase}_rss_peak_mib"])  # type: ignore[arg-type]
            lines.append(f"\n{phase}: {grown:+.0f} MiB of peak RSS for {extra:,} more images "
                         f"({grown * 2**20 / extra:.0f} bytes an image)")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = [one(n, args, out) for n in args.data_scale]
    with (out / "data-scale.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[-1]))
        writer.writeheader()
        writer.writerows(rows)
    command = "python -m ds_trainer.bench " + " ".join(args.argv)
    (out / "data-scale.md").write_text(table(rows, command))
    print((out / "data-scale.md").read_text())
    return 0 if all(r["cache_status"] == "ok" and r["train_status"] == "ok" for r in rows) else 1
