"""`python -m ds_trainer.convert`: checkpoints and exports without GPUs and without the run's world size.

- `convert <run> --to single_file,kohya,card` writes an earlier run's export in the layouts people load (as
  `export.formats` and `adapter.formats` write them now): `<run>/single_file/model[_ema].safetensors` from
  its diffusers export, `<run>/lora[_ema]/kohya.safetensors` from its diffusers LoRA file, `<run>/README.md`.
- `convert <checkpoint> --unet <dir>` writes the UNet or transformer (or with `--ema` its EMA) in diffusers format
  from a ds_trainer checkpoint: its portable state, or DeepSpeed's files (zero_to_fp32) for older checkpoints.
- `convert <accelerate save_state folder> --import-to <dir> --architecture sdxl_base` turns a DeepSpeed
  ZeRO-1/2/3 checkpoint written by Accelerate in another tool (diffusers' SDXL script, for example) into a
  ds_trainer checkpoint: fp32 weights and Adam moments from the ZeRO partitions (merged with
  zero_to_fp32's own functions), step, samples and LR schedule. `resume=<dir>` then continues from it
  under any configuration. Merging needs host memory for one full copy of each tensor kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds_trainer import console
from ds_trainer.config import rundir, schema

log = logging.getLogger("ds_trainer.convert")

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


class ConvertError(Exception):
    """A user mistake: printed as one message, exit status 2."""


class NotForThisRun(ConvertError):
    """A format of `--to` that does not apply to the kind of run (a single file of a LoRA run):
    skipped and said, the others written."""


def _portable_weights(checkpoint: Path) -> dict[str, Any] | None:
    from safetensors import safe_open

    meta_path = checkpoint / "portable" / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    out = {}
    for key, shard in meta["index"].items():
        if key.startswith("fp32/"):
            with safe_open(str(checkpoint / "portable" / shard), framework="pt") as f:
                out[key[len("fp32/"):]] = f.get_tensor(key)
    return out


def _weights(checkpoint: Path, ema: bool) -> dict[str, Any]:
    import torch

    if ema:
        if not (checkpoint / "ema.pt").is_file():
            raise ConvertError(f"{checkpoint}: no ema.pt (the run had train.ema=false)")
        return dict(torch.load(checkpoint / "ema.pt", map_location="cpu", weights_only=True)["shadow"])
    portable = _portable_weights(checkpoint)
    if portable is not None:
        return portable
    if (checkpoint / "model.safetensors").is_file():  # an older DDP checkpoint
        from safetensors.torch import load_file

        return dict(load_file(str(checkpoint / "model.safetensors")))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint)))


def _run_config(run_dir: Path) -> Any:
    """The run's config.yaml on the schema (typed as a run's; keys added since take their defaults)."""
    from omegaconf import DictConfig, OmegaConf


    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ConvertError(f"{run_dir}: no config.yaml (is it a ds_trainer run folder?)")
    saved = OmegaConf.load(config)
    cfg = OmegaConf.merge(OmegaConf.structured(schema.Config), saved, _about_of_older(saved))
    assert isinstance(cfg, DictConfig)
    return cfg


def _about_of_older(saved: Any) -> dict[str, Any]:
    """A run written before `model.about` existed: its model option's facts (license, base id,
    ...) as the option's yaml states them now, so its card names them as it did then; nothing for a
    run that has them, or whose option is not one of conf/model's."""
    from omegaconf import DictConfig, OmegaConf

    from ds_trainer import CONF_DIR

    option = CONF_DIR / "model" / f"{OmegaConf.select(saved, 'model.name')}.yaml"
    if OmegaConf.select(saved, "model.about") is not None:
        return {}
    if not option.is_file():
        return {}
    facts = OmegaConf.load(option)
    return {"model": {"about": facts.get("about", {}) if isinstance(facts, DictConfig) else {}}}


def export_unet(checkpoint: Path, out: Path, ema: bool = False) -> Path:
    """Write the checkpoint's UNet or transformer (fp32) as a diffusers folder; the architecture is the run's
    config.yaml. A LoRA or LyCORIS run's checkpoint holds the adapters: they are merged into the
    run's base (`model.pretrained`, unquantized), so the folder is the fine-tuned model, loadable
    with no adapter."""
    from ds_trainer.train import families

    cfg = _run_config(checkpoint.parent.parent)
    model = families.of(cfg).load_trained(cfg)
    weights = _weights(checkpoint, ema)
    component = families.component_of(model)
    prefix = f"{component}."
    if any(k.startswith(prefix) for k in weights):  # trained with its text encoders: this part
        weights = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
    adapted = cfg.adapter.method.value != "none"
    if adapted:
        from ds_trainer.train.adapters import adapter

        adapter.inject(cfg, model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trained & set(missing):
        what = f"adapter={cfg.adapter.method.value} rank {cfg.adapter.rank}"
        what = what if adapted else "a full fine-tune"
        raise ConvertError(f"{checkpoint}: the weights do not fit the run's model ({what}, as its "
                           f"config.yaml says): missing {sorted(trained & set(missing))[:3]}, unexpected "
                           f"{sorted(unexpected)[:3]}; is the checkpoint this run folder's own?")
    if adapted:
        model.fuse_lora()  # type: ignore[operator]
        model.unload_lora()  # type: ignore[operator]
        print(f"convert: adapter={cfg.adapter.method.value} merged into the base "
              f"({cfg.model.pretrained or cfg.model.name})", file=sys.stderr)
    model.save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    return out


def _frozen_parts(cfg: Any, run_dir: Path, suffix: str) -> dict[str, Any]:
    """What a family's single file holds beside the denoiser (SD3's VAE; SDXL's VAE and encoders): a fully trained
    encoder's export, else the run's pipeline folder's (a tiny model's, whose weights nobody else has), else the
    model's source."""
    from ds_trainer.train import families

    family = families.of(cfg)
    held = family.spec.single_file_parts
    if not held:
        return {}
    frozen = family.load_frozen(cfg)
    pipeline = run_dir / "pipeline"
    parts: dict[str, Any] = {"vae": frozen.vae}
    if (pipeline / "vae").is_dir():
        from diffusers import AutoencoderKL

        parts["vae"] = AutoencoderKL.from_pretrained(pipeline / "vae")
    for name in (p for p in held if p != "vae"):  # the text encoders it holds (SDXL's)
        source = next((d for d in (run_dir / f"{name}{suffix}", run_dir / name, pipeline / name) if d.is_dir()), None)
        parts[name] = type(getattr(frozen, name)).from_pretrained(source) if source else getattr(frozen, name)
    return parts


def single_files(run_dir: Path) -> list[Path]:
    """`<run>/single_file/model[_ema].safetensors` from the run's diffusers export (`<run>/unet[_ema]` or
    `<run>/transformer[_ema]`), in the run's `export.dtype`."""
    from ds_trainer.train import families
    from ds_trainer.train.export import single_file

    cfg = _run_config(run_dir)
    if cfg.adapter.method.value != "none":
        method = cfg.adapter.method.value
        raise NotForThisRun(f"adapter={method} trained a LoRA, not the whole model: its files are "
                            "in lora/ (kohya: --to kohya)")
    family = families.of(cfg)
    cls: Any = type(family.meta_trained(cfg))
    if not (run_dir / family.component).is_dir():
        raise ConvertError(f"{run_dir}: no {family.component}/ folder (the export of a full fine-tune; a LoRA run "
                           f"has none, and a run that did not finish has only checkpoints: --unet first)")
    out = []
    for suffix in ("", "_ema"):
        if (run_dir / f"{family.component}{suffix}").is_dir():
            denoiser = cls.from_pretrained(run_dir / f"{family.component}{suffix}")
            out.append(single_file.export(cfg, family, run_dir, denoiser, _frozen_parts(cfg, run_dir, suffix),
                                          ema=bool(suffix)))
    return out


def kohya_files(run_dir: Path) -> list[Path]:
    """`<run>/lora[_ema]/kohya.safetensors` from the run's diffusers LoRA files, on the run's adapters built on the
    meta device (only the LoRA tensors are read)."""
    from ds_trainer.train import families
    from ds_trainer.train.adapters import adapter, kohya_file, lora_file
    from ds_trainer.train.families import common
    from ds_trainer.train.layouts import metadata

    cfg = _run_config(run_dir)
    method = cfg.adapter.method.value
    if method == "none" and cfg.text_encoders.mode.value != "lora":
        raise NotForThisRun("a full fine-tune has no LoRA to write in kohya's layout (its single "
                            "file: --to single_file)")
    if method in schema.LYCORIS_METHODS:
        raise NotForThisRun(f"adapter={method} writes its LyCORIS-layout file as the run trains "
                            f"(lora/{kohya_file.WEIGHT_NAME}); there is nothing to convert")
    if method == "dora":
        raise NotForThisRun("adapter=dora has no kohya-layout form: ComfyUI's and LyCORIS' DoRA "
                            "normalise the weight's input columns, peft's its output rows "
                            f"(docs/lora.md); load lora/{lora_file.WEIGHT_NAME} with diffusers' "
                            "load_lora_weights")
    cfg.adapter.init_from = None
    family = families.of(cfg)
    encoders = _meta_encoders(cfg) if cfg.text_encoders.mode.value == "lora" else {}
    trained = adapter.build(cfg, family.meta_trained(cfg), encoders or None)
    dtype = common.SAVE_DTYPES[cfg.adapter.save_dtype.value]
    out = []
    for folder in ("lora", "lora_ema"):
        path = run_dir / folder / lora_file.WEIGHT_NAME
        if not path.is_file():
            continue
        values = lora_file.read_module(path, trained.module)
        weights = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                   for k, v in values.items()}
        header = metadata.kohya_lora(cfg, family, run_dir, folder == "lora_ema")
        out.append(kohya_file.write(run_dir / folder, trained.module, weights, dtype, header))
    if not out:
        raise ConvertError(f"{run_dir}: no lora/{lora_file.WEIGHT_NAME} (a LoRA run's export)")
    return out


def _meta_encoders(cfg: Any) -> dict[str, Any]:
    """SDXL's encoders that trained as LoRA, on the meta device, with the run's adapters."""
    from ds_trainer.train.families import text_encoders
    from ds_trainer.train.families.common import source

    path, kwargs = source(cfg)
    out = {}
    for name in text_encoders.trained(cfg):
        encoder = text_encoders.meta_encoder(path, name, **kwargs)
        text_encoders.prepare_encoder(text_encoders.Spec.of(cfg), name, encoder)
        out[name] = encoder
    return out


def card(run_dir: Path) -> Path:
    """`<run>/README.md`, the model card, from the run's config, summary.json and metrics.jsonl."""
    from ds_trainer.train.export import card as model_card

    cfg = _run_config(run_dir)
    summary, validations = model_card.facts_of(run_dir)
    path = run_dir / "README.md"
    path.write_text(model_card.text(cfg, run_dir, summary, validations))
    return path
def _merge(kind_groups: list[list[Any]], stage: int, world: int, model_states: Any, paddings: Any) -> dict[str, Any]:
    """Full tensors by name from per-rank ZeRO partitions, with zero_to_fp32's own merge."""
    from collections import OrderedDict

    from deepspeed.utils import zero_to_fp32 as z

    merged: dict[str, Any] = OrderedDict()
    if stage <= 2:
        z._zero2_merge_trainable_params(merged, world, kind_groups, model_states, paddings)
    else:
        z._zero3_merge_trainable_params(merged, world, kind_groups, model_states)
    return dict(z.to_torch_tensor(merged))


def import_accelerate(source: Path, out: Path, architecture: str, optimizer: str = "adamw") -> Path:
    """A ds_trainer checkpoint (portable state + COMPLETE) from an Accelerate/DeepSpeed `save_state`
    folder, read without unpickling anything but its tensors and DeepSpeed's records
    (`_weights_only`)."""
    with _weights_only(source):
        return _import_accelerate(source, out, architecture, optimizer)


@contextlib.contextmanager
def _weights_only(source: Path) -> Iterator[None]:
    """Inside, every `torch.load` (DeepSpeed's zero_to_fp32 and ours) uses torch's weights-only
    unpickler, which builds tensors, numbers, strings and containers, plus the few DeepSpeed classes
    its checkpoints hold as data (ZeRO's stage, a fragment's address, the loss scaler's numbers): a
    checkpoint from another tool is imported without running anything it holds. One that holds more
    is refused, named."""
    import pickle

    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    def member(owner: Any, name: str) -> Any:  # pickle's `getattr`: ZeRO's stage names only
        if owner is ZeroStageEnum and name in ZeroStageEnum.__members__:
            return ZeroStageEnum[name]
        raise pickle.UnpicklingError(f"getattr({owner!r}, {name!r}) is not a ZeRO stage's name")

    allowed = [ZeroStageEnum, fragment_address, LossScaler, (member, "builtins.getattr")]
    plain = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return plain(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            why = str(exc).strip().splitlines()[0][:240]
            raise ConvertError(
                f"{f}: holds objects other than tensors and DeepSpeed's own records, which "
                f"unpickled could run code ({why}); nothing was imported from {source}. Import a "
                "checkpoint that Accelerate's save_state under DeepSpeed wrote, as it wrote it",
            ) from None

    torch.load = load  # type: ignore[assignment]
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        torch.load = plain  # type: ignore[assignment]


def _import_accelerate(source: Path, out: Path, architecture: str, optimizer: str) -> Path:
    """The import itself (`import_accelerate`)."""
    import torch
    from deepspeed.utils import zero_to_fp32 as z
    from safetensors.torch import save_file

    tag_dirs = [d for d in source.iterdir() if d.is_dir() and list(d.glob("*optim_states.pt"))]
    if len(tag_dirs) != 1:
        raise ConvertError(f"{source}: expected one DeepSpeed checkpoint folder with *_optim_states.pt files inside "
                           f"(Accelerate's save_state under ZeRO-1/2/3), found {len(tag_dirs)}")
    ds_dir = tag_dirs[0]
    model_states = z.parse_model_states(z.get_model_state_files(str(ds_dir)))
    optim = [torch.load(f, map_location="cpu", weights_only=True)["optimizer_state_dict"]
             for f in z.get_optim_files(str(ds_dir))]
    stage, world = int(optim[0]["zero_stage"]), len(optim)
    inner_key, flat_key = ("base_optimizer_state", "single_partition_of_fp32_groups") if stage <= 2 else \
        ("optimizer_state_dict", "fp32_flat_groups")
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for kind in KINDS:
        groups = [o[flat_key] if kind == "fp32" else [o[inner_key]["state"][g][kind] for g in
                                                      sorted(o[inner_key]["state"])] for o in optim]
        for name, value in _merge(groups, stage, world, model_states, optim[0].get("param_alignment_paddings")).items():
            if name in {n for d in model_states[0].param_shapes for n in d}:
                tensors[f"{kind}/{name}"] = value.float().contiguous()
                shapes[name] = list(value.shape)
    first_state = optim[0][inner_key]["state"][min(optim[0][inner_key]["state"])]
    group = optim[0][inner_key]["param_groups"][0]
    main = torch.load(z.get_model_state_files(str(ds_dir))[0], map_location="cpu",
                      weights_only=True)
    step, samples = int(main["global_steps"]), int(main["global_samples"])
    (out / "portable").mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "portable" / "state-00001.safetensors"))
    # DeepSpeed's schedulers store their position; a torch scheduler (Accelerate's scheduler.bin) is not
    # ds_trainer's schedule, which then continues at the imported step.
    sched = main.get("lr_scheduler") or {"last_batch_iteration": step - 1}
    torch.save(sched, out / "portable" / "scheduler.pt")
    meta = {"format": 1, "imported_from": str(source),
            "layout": {"zero": f"imported-stage{stage}", "world_size": world},
            "identity": {"optimizer": optimizer, "architecture": architecture, "adapter": None},
            "step": step, "samples": samples, "optimizer_step": int(first_state["step"]), "moments": True,
            "hyper": {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group},
            "params": shapes, "index": dict.fromkeys(tensors, "state-00001.safetensors"),
            "bytes": sum(t.numel() * 4 for t in tensors.values())}
    (out / "portable" / "meta.json").write_text(json.dumps(meta, indent=1, default=list))
    (out / "COMPLETE").write_text(json.dumps({"backend": "deepspeed", "stage": stage, "world_size": world,
                                              "fingerprint": None, "step": step, "imported_from": str(source)}))
    return out


FORMATS = {"single_file": single_files, "kohya": kohya_files, "card": lambda run_dir: [card(run_dir)]}


def _to(run_dir: Path, formats: str) -> tuple[list[Path], dict[str, str]]:
    """The files of each format asked for that applies to the run, and why each other was skipped."""
    wanted = [f.strip() for f in formats.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in FORMATS]
    if unknown or not wanted:
        raise ConvertError(f"--to {formats}: {', '.join(unknown) or 'nothing'} is not one of {', '.join(FORMATS)}")
    written: list[Path] = []
    skipped: dict[str, str] = {}
    for name in wanted:
        try:
            written += FORMATS[name](run_dir)
        except NotForThisRun as exc:
            skipped[name] = str(exc)
    return written, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.convert", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path,
                        help="a run folder (with --to), a ds_trainer checkpoint, or an Accelerate save_state folder")
    parser.add_argument("--to", help="with a run folder: what to write from its export, of single_file, kohya, card "
                                     "(comma-separated)")
    parser.add_argument("--unet", type=Path, help="write the UNet or transformer in diffusers format here")
    parser.add_argument("--ema", action="store_true", help="with --unet: the EMA weights")
    parser.add_argument("--import-to", type=Path, help="import a DeepSpeed save_state folder as a checkpoint")
    parser.add_argument("--architecture", default="sdxl_base", help="with --import-to: the model's architecture")
    parser.add_argument("--optimizer", default="adamw", help="with --import-to: the source's optimizer (adam/adamw)")
    args = parser.parse_args(argv)
    console.for_tool(logging.INFO)
    try:
        if not args.checkpoint.is_dir():
            raise ConvertError(f"{args.checkpoint}: not a folder")
        if sum(x is not None for x in (args.to, args.unet, args.import_to)) != 1:
            raise ConvertError("give one of --to single_file,kohya,card (a run's export), --unet <dir> (a checkpoint's "
                               "weights) or --import-to <dir> (import)")
        if args.to is not None:
            written, skipped = _to(args.checkpoint, args.to)
            for path in written:
                rundir.follow_umask(path)
                print(f"wrote {path}")
            reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items())
            if not written:
                raise ConvertError(f"--to {args.to}: nothing of it applies to {args.checkpoint} "
                                   f"({reasons})")
            for name, why in skipped.items():
                print(f"skipped {name}: {why}")
        elif args.unet is not None:
            unet = export_unet(args.checkpoint, args.unet, args.ema)
            rundir.follow_umask(unet)
            print(f"wrote {unet}")
        else:
            imported = import_accelerate(args.checkpoint, args.import_to, args.architecture,
                                         args.optimizer)
            rundir.follow_umask(imported)
            print(f"wrote {imported}; continue with resume={args.import_to}")
    except ConvertError as exc:
        print(f"ds_trainer.convert: {exc}", file=sys.stderr)
        return 2
    return 0
