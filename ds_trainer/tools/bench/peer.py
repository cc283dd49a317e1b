"""`python -m ds_trainer.bench --startup-pairs N --peer-script <train_text_to_image_sdxl.py>`: diffusers' own SDXL
example script timed beside each run, on the same weights, images, batch, resolution, steps and optimizer.

The script is not part of ds_trainer: the user passes its path, and the Python that runs it needs the `datasets`
and `torchvision` packages (`--peer-python`). Both sides train from one pretrained folder (the model's configs with
seeded random weights, saved once with `save_pretrained`) and one folder of captioned PNGs (a `metadata.jsonl` with
`file_name` and `text`, which ds_trainer's `data=folder` and the script's `datasets` imagefolder both read), each
with a cold data cache of its own per run. The script's first step is timed from outside like a run's: from its
process start to the first update of its tqdm `Steps:` bar that shows step 1; its s/it are the bar's later steps.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import selectors
import shlex
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGES = 16
STEP = re.compile(r"Steps:\s*\d+%\|[^|\r\n]*\|\s*(\d+)/(\d+)\s*\[")  # Steps:  10%|█     | 1/10 [00:01<00:09, ...


@dataclass(frozen=True)
class Peer:
    """diffusers' script (run by `python`) and the pretrained folder and images it shares with the runs."""

    script: Path
    python: str
    model_dir: Path
    images_dir: Path

    def overrides(self, folder: Path) -> list[str]:
        """The ds_trainer overrides that train from the same folders, with a data cache of the run's own."""
        return [f"model.pretrained={self.model_dir}", "data=folder", f"data.path={self.images_dir}",
                f"data.cache_dir={folder / 'cache'}"]

    def command(self, folder: Path) -> list[str]:
        """The script's command line, mirroring the run in `folder` (its resolved config.yaml)."""
        cfg = cfg_of(folder)
        o, t = cfg.optimizer, cfg.train
        precision = {"bf16": "bf16", "bf16_pure": "bf16", "fp16": "fp16"}.get(str(cfg.precision.name), "no")
        data = [f"--pretrained_model_name_or_path={self.model_dir}", f"--train_data_dir={self.images_dir}",
                "--caption_column=text", f"--resolution={cfg.resolution.width}"]
        cmd = [self.python, *launcher(folder, cfg), str(self.script), *data, f"--train_batch_size={t.micro_batch_size}",
               f"--gradient_accumulation_steps={t.gradient_accumulation_steps}",
               f"--max_train_steps={t.max_steps}", f"--learning_rate={o.lr}", f"--adam_beta1={o.betas[0]}",
               f"--adam_beta2={o.betas[1]}", f"--adam_epsilon={o.eps}", f"--adam_weight_decay={o.weight_decay}",
               f"--max_grad_norm={t.gradient_clipping}", f"--seed={t.seed}", f"--mixed_precision={precision}",
               "--dataloader_num_workers=0", "--checkpointing_steps=1000000000", "--report_to=tensorboard",
               f"--output_dir={folder / 'peer'}", f"--cache_dir={folder / 'peer_cache'}"]
        return cmd + (["--center_crop"] if cfg.data.center_crop else []) + (
            ["--gradient_checkpointing"] if t.gradient_checkpointing else [])

    def measure(self, folder: Path, timeout: float, warmup: int = 2) -> dict[str, Any]:
        """Run the script beside the run in `folder`: s to its first step, median s/it after `warmup` steps, status
        (its output goes to `<folder>/peer.log`)."""
        if not (folder / "config.yaml").exists():
            return {"peer_status": "not run: the run wrote no config.yaml"}
        cmd = self.command(folder)
        # No hub: every file is local (a missing one fails at once instead of waiting on the network).
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=folder)
        clock, late = watch(proc, launched + timeout)
        (folder / "peer.log").write_text(shlex.join(cmd) + "\n\n" + clock.text)
        lines = [line.strip() for line in re.split(r"[\r\n]", clock.text) if line.strip()]
        # The error itself, not a launcher's banner after it (accelerate launch ends with torch's ChildFailedError).
        last = [line for line in lines if re.search(r"\b\w+Error: ", line)][:1] or lines[-1:]
        status = ("ok" if proc.returncode == 0 and clock.total in clock.seen else f"no result within {timeout:.0f} s"
                  if late else f"exit {proc.returncode}: {last[0] if last else '?'}")
        return {"peer_first_step_s": round(clock.seen[1] - launched, 3) if 1 in clock.seen else None,
                "peer_s_per_it": _median_s_per_it(clock.seen, warmup), "peer_status": status,
                "peer_backend": backend(cfg_of(folder))}


def cfg_of(folder: Path) -> Any:
    """The resolved config a run wrote in `folder`."""
    from omegaconf import OmegaConf

    return OmegaConf.load(folder / "config.yaml")


def backend(cfg: Any) -> str:
    """How the script runs beside the run of `cfg`: under the run's DeepSpeed stage (through `accelerate launch`, as
    a user of the script would run it), or as a plain Python process."""
    if str(cfg.resolved.backend) == "deepspeed":
        return f"DeepSpeed ZeRO-{int(cfg.zero.stage)} (accelerate launch)"
    if str(cfg.resolved.backend) == "fsdp" and str(cfg.resolved.platform) != "cpu":
        return "FSDP2 (accelerate launch)"
    return "plain python" + (" (Accelerate gives a CPU process no FSDP)" if str(cfg.resolved.backend) == "fsdp" else "")


def launcher(folder: Path, cfg: Any) -> list[str]:
    """The arguments that put the script under the run's backend: `-m accelerate.commands.launch --config_file <the
    run's Accelerate config>` for DeepSpeed (its JSON without the optimizer and scheduler blocks: the script brings
    torch's AdamW and its own LR schedule) and for FSDP on a GPU; nothing for DDP on one process, and for FSDP on a
    CPU, where Accelerate would quietly run the script without FSDP."""
    import yaml

    kind = str(cfg.resolved.backend)
    if kind == "deepspeed":
        ds = json.loads((folder / "ds_config.json").read_text())
        for block in ("optimizer", "scheduler"):
            ds.pop(block, None)
        (folder / "peer_ds_config.json").write_text(json.dumps(ds, indent=2))
        accel = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
        accel["deepspeed_config"]["deepspeed_config_file"] = str(folder / "peer_ds_config.json")
    elif kind == "fsdp" and str(cfg.resolved.platform) != "cpu":
        accel = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    else:
        return []
    (folder / "peer_accelerate_config.yaml").write_text(yaml.safe_dump(accel, sort_keys=False))
    return ["-m", "accelerate.commands.launch", "--config_file", str(folder / "peer_accelerate_config.yaml")]


def watch(proc: subprocess.Popen[bytes], deadline: float) -> tuple[StepClock, bool]:
    """Read the process's output as it comes until it ends: its steps and output, and whether the deadline passed
    (the process is then killed)."""
    assert proc.stdout is not None
    clock, decoder, late = StepClock(), codecs.getincrementaldecoder("utf-8")(errors="replace"), False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if (left := deadline - time.time()) <= 0:
                proc.kill()
                late = True
                break
            if not selector.select(left):
                continue
            data = os.read(proc.stdout.fileno(), 1 << 16)
            if not data:
                break
            clock.feed(decoder.decode(data), time.time())
    proc.wait()
    proc.stdout.close()
    return clock, late


class StepClock:
    """The steps a tqdm bar shows in a stream of output, each with the time it first arrived (`seen`), and the bar's
    total. tqdm rewrites its line after a carriage return and flushes each update whole, so a line is read as soon as
    it arrives, before the next carriage return ends it."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.total: int | None = None
        self.text = ""
        self._line = ""

    def feed(self, chunk: str, now: float) -> None:
        """Read the next piece of the script's output, arrived at `now`."""
        self.text += chunk
        *ended, self._line = re.split(r"[\r\n]", self._line + chunk)
        for line in [*ended, self._line]:
            if match := STEP.search(line):
                self.seen.setdefault(int(match.group(1)), now)
                self.total = int(match.group(2))


def _median_s_per_it(seen: dict[int, float], warmup: int) -> float | None:
    """Median time a step, over the steps after `warmup` (a gap between two shown steps is shared among them)."""
    steps = sorted(seen)
    spans = [(seen[b] - seen[a]) / (b - a) for a, b in zip(steps, steps[1:], strict=False) if a >= warmup]
    return round(statistics.median(spans), 4) if spans else None


def prepare(args: Any, out: Path) -> Peer:
    """The pretrained folder and the folder of images both sides train from, written once under `<out>/peer_inputs`
    (seed 0, the runs' train.seed), and a check that `--peer-python` has the script's extra packages."""
    check = subprocess.run([args.peer_python, "-c", "import datasets, torchvision"], capture_output=True, text=True)
    if check.returncode:
        last = check.stderr.strip().splitlines()[-1:] or ["?"]
        raise SystemExit(f"--peer-script needs the datasets and torchvision packages in --peer-python="
                         f"{args.peer_python} ({last[0]}); pip install -e . (datasets) and the torchvision built "
                         "for your torch (docs/bench.md)")
    res = args.resolutions[0]
    model_dir = out / "peer_inputs" / f"{args.model}-seed0"
    images_dir = out / "peer_inputs" / f"images-{IMAGES}-px{res}-seed0"
    _write_once(model_dir, lambda tmp: _save_pipeline(args.model, 0, tmp))
    _write_once(images_dir, lambda tmp: _save_images(res, 0, tmp))
    return Peer(args.peer_script.resolve(), args.peer_python, model_dir.resolve(), images_dir.resolve())


def _write_once(folder: Path, write: Callable[[Path], None]) -> None:
    """Write `folder` unless it exists, through a temporary folder: an interrupted write leaves no half folder."""
    if folder.exists():
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    tmp.rename(folder)


def _save_pipeline(model: str, seed: int, folder: Path) -> None:
    """The model as ds_trainer builds it at random init from `seed`, saved as a diffusers SDXL pipeline folder."""
    from diffusers import StableDiffusionXLPipeline
    from omegaconf import OmegaConf

    from ds_trainer import ASSETS_DIR
    from ds_trainer.train.families import sdxl

    cfg = OmegaConf.create({"model": {"pretrained": None, "vae": None, "architecture": str(ASSETS_DIR / model)},
                            "train": {"seed": seed, "gradient_checkpointing": False}})
    frozen = sdxl.load_frozen(cfg)
    pipe = StableDiffusionXLPipeline(vae=frozen.vae, text_encoder=frozen.text_encoder,
                                     text_encoder_2=frozen.text_encoder_2, tokenizer=frozen.tokenizer,
                                     tokenizer_2=frozen.tokenizer_2, unet=sdxl.load_unet(cfg),
                                     scheduler=sdxl.inference_scheduler(cfg))
    pipe.save_pretrained(folder)  # type: ignore[attr-defined]


def _save_images(res: int, seed: int, folder: Path) -> None:
    """IMAGES of ds_trainer's synthetic images (a colored shape, with noise) as PNGs, captions in metadata.jsonl."""
    import torch
    from omegaconf import OmegaConf
    from PIL import Image

    from ds_trainer.train.data import SyntheticImages

    images = SyntheticImages(OmegaConf.create({"data": {"num_samples": IMAGES}, "train": {"seed": seed},
                                               "resolution": {"width": res, "height": res}}))
    rows = []
    for i in range(len(images)):
        example = images[i]
        pixels = ((example.pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
        Image.fromarray(pixels.numpy()).save(folder / f"{i:04d}.png")
        rows.append(json.dumps({"file_name": f"{i:04d}.png", "text": example.caption}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
