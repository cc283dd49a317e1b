"""An editing model's reference images (`model.reference_images`: Flux.1 Kontext, Qwen-Image-Edit): the data must
pair each image with its reference (synthetic pairs, a folder's data.control_path, a source's control_path or
control_column), the samples must name theirs (samples.images); a model that reads none is not given any.
Qwen-Image-Edit encodes each caption with its reference, once, into the cache: captions that change from sample to
sample are refused. Torch-free."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ds_trainer.config import families, source_kinds, source_repeats
from ds_trainer.config.problems import Problem

EDITING = ("flux", "qwen_image")  # the families with a reference-image input (Kontext's, Qwen-Image-Edit's)


def problems(cfg: DictConfig) -> list[Problem]:
    if not cfg.model.get("reference_images") and starts_from_image(cfg):  # a clip's first frame
        return (_unread(cfg, samples_too=False)
                + _samples(cfg, "starts each sample clip from an image"))
    if not cfg.model.get("reference_images"):
        return _unread(cfg)
    out: list[Problem] = _count(cfg)
    family = cfg.model.family.value
    if family not in EDITING:
        out.append(Problem("model.reference_images", True, f"model.family={family} has no reference-image input; "
                           "Flux.1 Kontext's and Qwen-Image-Edit's are the ones built", "model=flux_kontext_dev "
                           "or model=qwen_image_edit (their _tiny ones too), or model.reference_images=false"))
    out += _data(cfg)
    if captions_fixed(cfg):
        out += _captions_fixed(cfg)
    if cfg.validation.get("path"):
        out.append(Problem("validation.path", cfg.validation.path, "a folder of other images has no reference images "
                           "paired with them", "validation.split=0.05 (pairs held out of the data), or "
                           "validation.path=null"))
    return out + _samples(cfg)


def _data(cfg: DictConfig) -> list[Problem]:
    """Where each training image's reference comes from."""
    source = cfg.data.source.value
    if source == "folder" and not cfg.data.get("control_path"):
        return [Problem("data.control_path", None, f"model={cfg.model.name} edits a reference image: each image "
                        "needs its own, under the same relative path and name in another folder",
                        "data.control_path=/path/to/references")]
    if source == "folder" and not Path(str(cfg.data.control_path)).is_dir():
        return [Problem("data.control_path", cfg.data.control_path, "is not a folder",
                        "data.control_path=/path/to/references")]
    out = []
    for index, entry in enumerate(cfg.data.sources if source == "sources" else []):
        key, path = f"data.sources[{index}]", str(entry.path)
        kind = str(getattr(entry.kind, "value", entry.kind))
        pairing = source_kinds.KINDS[source_kinds.kind_of(path, kind)]
        table, folder = pairing.references == "control_column", pairing.references == "control_path"
        if table and not entry.get("control_column"):
            out.append(Problem(f"{key}.control_column", None, f"model={cfg.model.name} edits a reference image: the "
                               "table names each image's reference in a column of paths", f"{key}.control_column="
                               "control_image (the column's name)"))
        elif folder and not entry.get("control_path"):
            out.append(Problem(f"{key}.control_path", None, f"model={cfg.model.name} edits a reference image: each "
                               "image needs its own, under the same relative path and name in another folder",
                               f"{key}.control_path=/path/to/references"))
        elif not table and not folder:
            out.append(Problem(f"{key}.kind", kind, "reference images are paired by name from folders and tables; "
                               "tar shards and saved datasets do not carry them here", f"{key}.path=<a folder or a "
                               ".jsonl/.csv/.parquet table> with its control_path or control_column"))
    return out


def captions_fixed(cfg: DictConfig) -> bool:
    """Whether the model encodes each caption with its reference image (Qwen-Image-Edit): once, into the cache, so a
    caption is never dropped nor changed from sample to sample."""
    return bool(cfg.model.get("reference_images")) and families.of(cfg).caption_sees_reference


def _captions_fixed(cfg: DictConfig) -> list[Problem]:
    """Qwen-Image-Edit's captions are encoded with their reference image into the cache, once: one encoding per
    image, so no caption dropped (an empty prompt with the image's own reference) or changed from sample to sample."""
    why = (f"model={cfg.model.name} encodes each caption with its reference image, once, into the cache; a caption "
           "that changes from sample to sample would be encoded every step with its image")
    out = []
    sources = cfg.data.sources if cfg.data.source.value == "sources" else []
    dropped = [("data.caption_dropout", cfg.data.caption_dropout)] + [
        (f"data.sources[{i}].caption_dropout", s.caption_dropout) for i, s in enumerate(sources)
        if s.get("caption_dropout") is not None]
    out += [Problem(key, value, why, f"{key}=0") for key, value in dropped if float(value) > 0]
    if source_repeats.tags_vary(cfg):
        out.append(Problem("data.tag_shuffle", cfg.data.tag_shuffle, why + " (tags shuffled or dropped)",
                           "data.tag_shuffle=false data.tag_dropout=0 (and the sources' own)"))
    return out


def starts_from_image(cfg: DictConfig) -> bool:
    """Whether a video model is given its clip's first frame (model.video.condition), which its
    samples take from samples.images."""
    video = cfg.model.get("video")
    return families.of(cfg).video and video is not None and video.condition.value != "none"


def _count(cfg: DictConfig) -> list[Problem]:
    """model.references: from 1 to the most the family's editing pipeline takes."""
    count, spec = int(cfg.model.get("references") or 1), families.of(cfg)
    if 1 <= count <= spec.references:
        return []
    return [Problem("model.references", count, f"{spec.label}'s editing pipeline takes 1 to "
                    f"{spec.references} reference image(s) a sample",
                    f"model.references={min(max(count, 1), spec.references)}")]


def _samples(cfg: DictConfig, what: str = "edits a reference image") -> list[Problem]:
    """Each sample prompt's reference image (an image to video model's first frame)."""
    s = cfg.samples
    images = list(s.get("images") or [])
    if not s.enabled:
        return []
    if not images:
        return [Problem("samples.images", [],
                        f"model={cfg.model.name} {what}: each sample prompt needs one",
                        "samples.images=[/path/to/reference.png] (one for every prompt, or one "
                        "each)")]
    # several references of one prompt are joined by "+" (a.png+b.png)
    out = [Problem("samples.images", image, "no such image file", "samples.images=[/path/to/reference.png]")
           for entry in images for image in str(entry).split("+") if not Path(image).is_file()]
    most = int(cfg.model.get("references") or 1)
    out += [Problem("samples.images", entry, f"{len(str(entry).split('+'))} reference images "
                    f"for one prompt; model.references={most}", f"at most {most} joined by '+'")
            for entry in images if len(str(entry).split("+")) > most]
    prompts = s.prompts if not isinstance(s.prompts, str) else None
    if prompts is not None and len(images) not in (1, len(prompts)):
        out.append(Problem("samples.images", f"[{len(images)} images]", f"pairs with samples.prompts' {len(prompts)} "
                           "prompts one to one, or one image serves them all", "one image, or one per prompt"))
    return out


def _unread(cfg: DictConfig, samples_too: bool = True) -> list[Problem]:
    """Reference images given to a model that reads none: said, not ignored (`samples_too`: the
    samples' too; an image to video model's samples start from theirs)."""
    fix = "model=flux_kontext_dev or model=qwen_image_edit (editing models), or drop it"
    out = []
    if cfg.data.get("control_path"):
        out.append(Problem("data.control_path", cfg.data.control_path, f"model={cfg.model.name} reads no reference "
                           "images (model.reference_images=false)", fix))
    for index, entry in enumerate(cfg.data.sources if cfg.data.source.value == "sources" else []):
        for key in ("control_path", "control_column"):
            if entry.get(key):
                out.append(Problem(f"data.sources[{index}].{key}", entry[key], f"model={cfg.model.name} reads no "
                                   "reference images (model.reference_images=false)", fix))
    if int(cfg.model.get("references") or 1) != 1:
        out.append(Problem("model.references", cfg.model.references,
                           f"model={cfg.model.name} reads no reference images "
                           "(model.reference_images=false)", "model.references=1"))
    if samples_too and cfg.samples.enabled and cfg.samples.get("images"):
        out.append(Problem("samples.images", list(cfg.samples.images), f"model={cfg.model.name} samples from its "
                           "prompts alone (model.reference_images=false)", "samples.images=[]"))
    return out
