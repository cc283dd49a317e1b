"""`<run>/README.md`: the model card beside the exports, in the model hub's format (YAML front
matter, then Markdown): the base model and its license, what trained and how, the data, the
validation loss, the last samples with their prompts, and which file opens where. Written by rank 0
at the end of a run that exports (`export.card`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import families, schema
from ds_trainer.config.families import FamilySpec
from ds_trainer.train.layouts import metadata

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

def write(run: Run) -> Path:
    """`<run>/README.md`, from the run's config, its metrics and what the export wrote."""
    path = run.run_dir / "README.md"
    path.write_text(text(run.cfg, run.run_dir, run.tracker.facts, run.tracker.validations))
    return path


ADAPTER_LABELS = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr (LyCORIS)", "loha": "LoHa (LyCORIS)"}


def _front_matter(cfg: DictConfig, lora: bool) -> str:
    about = metadata.about(cfg)
    lines = ["---"]
    if about.get("base_id"):
        lines.append(f"base_model: {about['base_id']}")
    if about.get("license"):
        lines.append(f"license: {about['license']}")
    if about.get("license_name"):
        lines.append(f"license_name: {about['license_name']}")
    lines.append("library_name: diffusers")
    tags = ["ds_trainer", *families.of(cfg).tags, "lora" if lora else "full-fine-tune"]
    if cfg.model.get("reference_images"):  # an editing model (Kontext, Qwen-Image-Edit): its makers' pipeline tag
        tags = [("image-to-image" if t == "text-to-image" else t) for t in tags]
    video = cfg.model.get("video")
    if video is not None and metadata.value_of(video.condition) != "none":  # given the first frame
        tags = [("image-to-video" if t == "text-to-video" else t) for t in tags]
    lines.append("tags:")
    lines += [f"- {tag}" for tag in tags]
    lines.append("---")
    return "\n".join(lines)


def _what_trained(cfg: DictConfig, lora: bool) -> list[str]:
    component = families.of(cfg).module_label
    if lora:
        a = cfg.adapter
        since = f", continued from `{a.init_from}`" if a.init_from else ""
        label = ADAPTER_LABELS[metadata.value_of(a.method)]
        out = [f"- {component}: {label}, rank {a.rank}, alpha {a.alpha}, on the modules ending with "
               f"{', '.join(f'`{t}`' for t in a.targets)}{since}"]
    else:
        out = [f"- {component}: every weight (a full fine-tune)"]
    out += _experts(cfg)
    te = cfg.text_encoders
    mode = metadata.value_of(te.mode)
    if mode == "lora":
        out.append(f"- text encoders ({metadata.value_of(te.which)}): LoRA, rank {te.rank}, alpha {te.alpha}")
    elif mode == "full":
        out.append(f"- text encoders ({metadata.value_of(te.which)}): every weight")
    else:
        out.append("- text encoders: frozen")
    return out


def _experts(cfg: DictConfig) -> list[str]:
    """A model of two experts (Wan 2.2 A14B): which trained, on which timesteps."""
    video = cfg.model.get("video")
    if video is None or video.get("boundary") is None:
        return []
    expert, boundary = metadata.value_of(video.expert), video.boundary
    if expert == "both":
        return [f"- experts: both (`model.video.expert=both`), one after the other, each "
                f"{cfg.train.max_steps} steps on its own timesteps: the high-noise one (sigma "
                f"at or above {boundary}, `experts/high`), then the low-noise one beside it "
                "(`experts/low`)"]
    other = video.get("other_expert") or "the base model's"
    return [f"- experts: the {expert}-noise one (`model.video.expert={expert}`, boundary "
            f"{boundary}); the other is {other}, as it was"]


def _training(cfg: DictConfig, facts: dict[str, Any]) -> list[str]:
    data = cfg.data
    source = metadata.value_of(data.source) + (f" (`{data.path}`)" if data.path else "")
    images = facts.get("images")
    res = f"{cfg.resolution.width}x{cfg.resolution.height}"
    if cfg.model.get("video") is not None:  # a video model's clips
        frames = " and ".join(str(n) for n in sorted(cfg.data.video.frames))
        res += f", clips of {frames} frame(s) at {cfg.model.video.fps:g} fps"
    buckets = facts.get("buckets")
    value = metadata.value_of
    backend = cfg.resolved.backend or value(cfg.zero.backend)
    out = [f"- steps: {cfg.train.max_steps}, micro-batch {cfg.train.micro_batch_size} x gradient accumulation "
           f"{cfg.train.gradient_accumulation_steps} x {cfg.resolved.world_size or 1} rank(s)",
           f"- data: {source}" + (f", {images} {_held(cfg)}" if images is not None else ""),
           f"- resolution: {res}" + (f", aspect-ratio buckets {buckets}" if data.buckets and buckets else
                                     (", aspect-ratio buckets" if data.buckets else ", no buckets")),
           f"- optimizer: {value(cfg.optimizer.name)}, learning rate {cfg.optimizer.lr}, schedule "
           f"{value(cfg.scheduler.name)}",
           f"- precision: {value(cfg.precision.name)}; backend: {backend}"
           + (f", ZeRO stage {cfg.zero.stage}" if str(cfg.resolved.backend or "") == "deepspeed" else "")
           + f", offload {value(cfg.offload.device)}",
           f"- EMA: {'decay ' + str(cfg.train.ema_decay) if cfg.train.ema else 'off'}; seed {cfg.train.seed}"]
    for entry in facts.get("sources", []) if len(facts.get("sources", [])) > 1 or cfg.data.caption_dropout else []:
        out.append(f"  - `{entry['name']}` ({entry['kind']}): {entry['images']} images x {entry['repeats']:g} an "
                   f"epoch, {entry['samples_seen']} samples seen, {entry['captions_dropped']} with the caption dropped")
    return out


def _held(cfg: DictConfig) -> str:
    """What the data holds: images, or a video model's files (clips and images)."""
    return "images" if cfg.model.get("video") is None else "files"


def _validation(validations: list[dict[str, Any]]) -> list[str]:
    rows = [row for row in validations if "val_loss" in row]
    if not rows:
        return ["No validation loss was measured (`validation=on` measures one)."]
    best = min(rows, key=lambda row: row["val_loss"])
    out = [f"- final: {rows[-1]['val_loss']:.5f} at step {rows[-1]['step']}",
           f"- best: {best['val_loss']:.5f} at step {best['step']}"]
    ema_rows = [row for row in validations if "val_loss_ema" in row]
    if ema_rows:
        out.append(f"- EMA, final: {ema_rows[-1]['val_loss_ema']:.5f} at step {ema_rows[-1]['step']}")
    return out


def _prompts(cfg: DictConfig) -> list[str]:
    prompts = cfg.samples.prompts
    if isinstance(prompts, str):
        file = Path(prompts)
        return [line.strip() for line in file.read_text().splitlines() if line.strip()] if file.is_file() else []
    return [str(p) for p in prompts]


def _samples(cfg: DictConfig, run_dir: Path) -> list[str]:
    steps = sorted((run_dir / "samples").glob("step_*")) if (run_dir / "samples").is_dir() else []
    if not steps:
        return ["No samples were generated (`samples=on` generates them)."]
    last = steps[-1]
    prompts = _prompts(cfg)
    out = [f"At step {int(last.name.removeprefix('step_'))}, {cfg.samples.steps} sampling steps, guidance "
           f"{cfg.samples.guidance_scale}:", ""]
    for image in sorted([*last.glob("*_*.png"), *last.glob("*_*.mp4")]):
        index, seed = image.stem.split("_", 1)
        prompt = prompts[int(index)] if index.isdigit() and int(index) < len(prompts) else ""
        link = image.relative_to(run_dir).as_posix()
        out.append(f"[{prompt} (video)]({link})" if image.suffix == ".mp4" else f"![{prompt}]({link})")
        out.append(f"*{prompt}* (seed {seed})")
        out.append("")
    return out


def _files(spec: FamilySpec, run_dir: Path, method: str = "lora", scale: float = 1.0) -> list[str]:
    """Each exported file and what opens it. `scale`: the LoRA's alpha / rank, which the
    diffusers-layout file keeps in its metadata alone: ComfyUI, which reads a file's alpha tensors
    and applies 1 without them, is named for it only at 1."""
    kohya = spec.kohya_readers
    if method in schema.LYCORIS_METHODS:
        kohya = "ComfyUI (`models/loras`), Forge, kohya's tools with LyCORIS (diffusers does not load LoKr or LoHa)"
    diffusers = "diffusers' `load_lora_weights`"
    if spec.diffusers_lora_in_comfyui and method == "lora":
        diffusers += ", ComfyUI" if scale == 1.0 else (f" (ComfyUI would apply it at scale 1, not its alpha / rank of "
                                                       f"{scale:g}: use `lora/kohya.safetensors` there)")
    where = {
        "single_file/model.safetensors": "ComfyUI (`models/checkpoints`; Flux, Qwen-Image: `models/diffusion_models`), "
                                         "Forge, InvokeAI, diffusers' `from_single_file`",
        "single_file/model_ema.safetensors": "the EMA weights, as above",
        "lora/kohya.safetensors": kohya,
        "lora/pytorch_lora_weights.safetensors": diffusers,
        "lora_ema/kohya.safetensors": "the EMA of the LoRA, as lora/kohya.safetensors",
        "lora_ema/pytorch_lora_weights.safetensors": "the EMA of the LoRA, as lora/pytorch_lora_weights.safetensors",
        "unet": "diffusers' `UNet2DConditionModel.from_pretrained`", "unet_ema": "the EMA weights, as unet/",
        "transformer": "diffusers' `from_pretrained` of the transformer", "transformer_ema": "the EMA weights, as "
                                                                                              "transformer/",
        "transformer_2": "diffusers' `from_pretrained` of the pipeline's second transformer",
        "transformer_2_ema": "the EMA weights, as transformer_2/",
        "text_encoder": "transformers' `from_pretrained`", "text_encoder_2": "transformers' `from_pretrained`",
        "pipeline": "diffusers' `DiffusionPipeline.from_pretrained`",
    }
    out = ["| file | opens in |", "|---|---|"]
    for name, what in where.items():
        out += [f"| `{found}` | {what} |" for found in _found(run_dir, name)]
    return out


def _found(run_dir: Path, name: str) -> list[str]:
    """`name` where the run holds it, or under each phase's name in a run in phases
    (`lora/high/kohya.safetensors`)."""
    if (run_dir / name).exists():
        return [name]
    folder, _, file = name.partition("/")
    if not file or not (run_dir / folder).is_dir():
        return []
    return [f"{folder}/{sub.name}/{file}" for sub in sorted((run_dir / folder).iterdir())
            if (sub / file).exists()]


def text(cfg: DictConfig, run_dir: Path, facts: dict[str, Any],
         validations: list[dict[str, Any]]) -> str:
    """The card's text (also `python -m ds_trainer.convert --card` for an earlier run)."""
    method = metadata.value_of(cfg.adapter.method)
    lora = method != "none"
    kind = ADAPTER_LABELS.get(method, "LoRA")
    name = str(cfg.model.name)
    base = metadata.base_model(cfg)
    license_line = metadata.about(cfg).get("license_url")
    sections = [
        _front_matter(cfg, lora),
        f"# {name}: {kind if lora else 'fine-tune'} of {run_dir.parent.name} {run_dir.name}",
        f"{'A ' + kind if lora else 'A fine-tune'} of `{base}` ({metadata.architecture(cfg)}), trained with "
        "ds_trainer." + (f" The base model's license applies: {license_line}" if license_line else
                         " The base model's license applies to these weights."),
        "## What trained", "\n".join(_what_trained(cfg, lora)),
        "## Training", "\n".join(_training(cfg, facts)),
        "## Validation loss", "\n".join(_validation(validations)),
        "## Samples", "\n".join(_samples(cfg, run_dir)),
        "## Files", "\n".join(_files(families.of(cfg), run_dir, method, _scale(cfg) if lora else 1.0)),
        "## Configuration",
        "The whole configuration is in `config.yaml` beside this card; `python -m ds_trainer` with these overrides "
        "trains the same:",
        "```\n" + " ".join(_overrides(run_dir)) + "\n```",
    ]
    return "\n\n".join(sections) + "\n"


def _scale(cfg: DictConfig) -> float:
    """The adapter's alpha / rank (1 where the method has no alpha)."""
    a = cfg.adapter
    return float(a.alpha) / float(a.rank) if a.get("alpha") is not None and a.get("rank") else 1.0


def _overrides(run_dir: Path) -> list[str]:
    """The command line's overrides (Hydra's record of the run)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ["(no record of the command line)"]
    return [str(o) for o in OmegaConf.load(path)] or ["(the defaults)"]


def facts_of(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An earlier run's facts and validation rows, from its summary.json and metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "val_loss" in row:
                rows.append(row)
    return summary, rows
