"""Sample images during training, under every ZeRO stage: `Sampler.after_step` is called by the
recipe after each optimizer step, on every rank.

Under ZeRO-3 each UNet forward gathers the parameters from all ranks, so every rank must run the
same forwards: the (prompt, seed) pairs are dealt round robin and padded to a multiple of the world
size (a padding image is generated and dropped), every rank runs the same pipeline calls, and the
images are gathered to rank 0, which writes them and logs them to W&B (trackers live on rank 0
only). Whether to sample depends on the step only (`config.samples.due`); ranks check once at the
start that they agree on everything that decides their forwards, and fail with a message rather than
hang.

Sampling leaves training untouched: the noise comes from private generators, torch's global RNG
state is restored, the UNet's train/eval mode is restored, nothing records gradients. The pipeline
is the model family's (diffusers' StableDiffusionXLPipeline, StableDiffusion3Pipeline) around the
training UNet or transformer (or one built on the EMA shadow) with the frozen VAE and text encoders
and the exported scheduler, so the exported pipeline reproduces an image with `generate` (see
docs/samples.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import samples
from ds_trainer.errors import TrainingError
from ds_trainer.train import families
from ds_trainer.train.adapters import quantize
from ds_trainer.train.backends import accelerator as accel
from ds_trainer.train.backends import sharded
from ds_trainer.train.data import video
from ds_trainer.train.families import text_encoders
from ds_trainer.train.state.ema import EMA

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")


@dataclass(frozen=True)
class Settings:
    """How each image is generated (everything but the prompt and the seed)."""

    steps: int
    guidance_scale: float
    negative_prompt: str
    width: int
    height: int
    extra: tuple[tuple[str, Any], ...] = ()  # the family's own arguments (SD3: T5's max_sequence_length)
    images: tuple[str, ...] = ()  # an editing model's references: one per prompt, or one for all (samples.images)


def settings(cfg: DictConfig, family: families.Family) -> Settings:
    width, height = samples.size(cfg)
    s = cfg.samples
    return Settings(int(s.steps), float(s.guidance_scale), str(s.negative_prompt), width, height,
                    tuple(sorted(family.call_kwargs(cfg).items())), tuple(str(p) for p in s.get("images") or ()))


def reference(s: Settings, index: int) -> Any:
    """The reference image (PIL, RGB) of prompt `index` for an editing model, or None; a list of
    them where its samples.images entry joins several with "+" (a.png+b.png)."""
    if not s.images:
        return None
    from PIL import Image

    pictures = []
    for path in s.images[index if len(s.images) > 1 else 0].split("+"):
        with Image.open(path) as image:
            pictures.append(image.convert("RGB"))
    return pictures if len(pictures) > 1 else pictures[0]


def generate(pipe: Any, prompt: str, seed: int, s: Settings, image: Any = None) -> Any:
    """One image (PIL) from the family's pipeline: the call the sampler makes, and the one that
    reproduces its images from the exported pipeline. The latents come from a CPU generator, so the
    device does not change them; an empty negative prompt means SDXL's zeroed unconditional
    embedding (SD3's pipeline encodes an empty one); the family says which arguments carry the
    guidance scale and the negative prompt."""
    model = pipe.unet if hasattr(pipe, "unet") else pipe.transformer or pipe.transformer_2
    guidance = families.of_module(model).guidance_kwargs(s.guidance_scale, s.negative_prompt)
    out = pipe(prompt=prompt, num_inference_steps=s.steps, width=s.width, height=s.height,
               generator=torch.Generator().manual_seed(int(seed)), **guidance, **dict(s.extra),
               **({"image": image} if image is not None else {}))
    if hasattr(out, "frames"):  # a video model's clip: its frames
        return out.frames[0]
    return out.images[0]


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors to `dtype`, also in dicts and lists (Z-Image's transformer takes lists)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _dtype(value: Any) -> torch.dtype:
    """The dtype of a tensor, or of a list's first tensor."""
    return value.dtype if isinstance(value, torch.Tensor) else _dtype(value[0])


# The floating inputs of a UNet's or a transformer's forward besides its timestep.
_CONDITIONING = ("hidden_states", "encoder_hidden_states", "added_cond_kwargs", "pooled_projections")


@contextlib.contextmanager
def model_in_its_dtype(model: Any) -> Iterator[None]:
    """Run a 16-bit UNet or transformer (as DeepSpeed trains it) inside a float32 pipeline: its
    latents, text embeddings and added conditions are cast to the model's dtype, its prediction back
    to the latents' dtype; the timestep is left alone (Euler's float timesteps would round in bf16).
    Training casts the same way."""
    # The dtype of its family's first layer
    dtype = _compute_dtype(model.get_submodule(families.spec_of(model).input_layer))
    seen: list[torch.dtype] = []

    def before(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:  # noqa: ARG001 - torch's hook signature
        seen.append(_dtype(args[0] if args else kwargs["hidden_states"]))
        kwargs = {k: _cast(v, dtype) if k in _CONDITIONING else v for k, v in kwargs.items()}
        # Positional: the sample and the conditioning after the timestep (diffusers' second
        # argument, left alone): Z-Image's pipeline passes its caption features third
        return tuple(a if i == 1 else _cast(a, dtype) for i, a in enumerate(args)), kwargs

    def after(module: Any, args: tuple, output: Any) -> Any:  # noqa: ARG001 - torch's hook signature
        back = seen.pop()
        if isinstance(output, tuple):
            return (_cast(output[0], back), *output[1:])
        output.sample = _cast(output.sample, back)
        return output

    # Before any hook of the module's own (FSDP2 casts the inputs to its compute dtype and gathers
    # the root unit's weights in it): a cast after FSDP's would hand its root layers inputs in the
    # sharded masters' dtype.
    handles = [model.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
               model.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _vae_decode_in_its_dtype(vae: Any) -> Iterator[None]:
    """Latents in the text encoders' dtype decoded by a VAE in another (the pipeline casts only on
    MPS)."""
    dtype = vae.decoder.conv_in.weight.dtype
    parts = [m for m in (getattr(vae, "post_quant_conv", None), vae.decoder) if m is not None]
    handles = [m.register_forward_pre_hook(lambda m, args: (args[0].to(dtype), *args[1:])) for m in parts]  # noqa: ARG005
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def plain_linear() -> Iterator[None]:
    """torch's own F.linear while sampling. ZeRO-3 replaces it process-wide with a memory-efficient
    version (matmul, then the bias added in 16 bits) for the backward; inference needs none of that,
    and with torch's kernel a sample equals what the exported pipeline makes."""
    import sys

    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(zero, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if original is None or torch.nn.functional.linear is original:
        yield
        return
    patched = torch.nn.functional.linear
    torch.nn.functional.linear = original
    try:
        yield
    finally:
        torch.nn.functional.linear = patched


def _grid(images: list[Any], columns: int) -> Any:
    from PIL import Image

    w, h = images[0].size
    rows = math.ceil(len(images) / columns)
    grid = Image.new("RGB", (columns * w, rows * h))
    for k, image in enumerate(images):
        grid.paste(image, ((k % columns) * w, (k // columns) * h))
    return grid


def ema_model(accelerator: Any, model: Any, ema: EMA, key: str) -> Any:
    """A UNet or transformer on the EMA shadow (its tensors, not a copy, when the shadow is on the
    device): the same weights the export writes to `unet_ema` (`transformer_ema`) and the exported
    pipeline uses. Collective (the shadow is gathered from its shards on every rank); `key` names
    the setting that asked for it in the error."""
    module = accelerator.unwrap_model(model)
    with torch.device("meta"):
        built = type(module).from_config(module.config)
    # What never trains by design (Qwen-Image's last text-stream layers: families' `unused`) is the
    # live module's
    live_params = dict(module.named_parameters())
    fixed = {name: live_params[name] for name in sorted(set(live_params) - set(ema.names))
             if name.startswith(tuple(f"{u}." for u in families.of_module(module).unused(module)))}
    missing = {name for name, _ in built.named_parameters()} - set(ema.names) - set(fixed)
    if missing:
        raise TrainingError(f"{key}=true: the EMA holds only the trained parameters, not {len(missing)} "
                            f"others of the {families.label_of(module)}; use {key}=false")
    # Persistent buffers (SD3's position embedding) are no parameters: whole on every rank under
    # every layout, the live module's.
    live = dict(module.named_buffers())
    buffers = {name: _as_built(live[name]) for name in set(built.state_dict()) - set(ema.names) if name in live}
    built.load_state_dict({**buffers, **ema.layout.whole_copies(fixed), **ema.full()}, assign=True)
    _plain_tensors(built, module)
    return built.to(accelerator.device).eval()


def _compute_dtype(layer: Any) -> torch.dtype:
    """The dtype a layer computes in: its weight's, or for a quantized base's layer (quantize=:
    bitsandbytes' integer weights) the compute dtype it was given, else its bias's."""
    weight = layer.weight
    if weight.is_floating_point():
        return weight.dtype  # type: ignore[no-any-return]
    compute = getattr(layer, "compute_dtype", None)
    if isinstance(compute, torch.dtype):
        return compute
    bias = getattr(layer, "bias", None)
    return bias.dtype if isinstance(bias, torch.Tensor) and bias.is_floating_point() else torch.float32


def _plain_tensors(built: torch.nn.Module, live: torch.nn.Module) -> None:
    """The tensors a module keeps as plain attributes (no parameter: Qwen-Image's RoPE
    frequencies) or as buffers left out of its state dict (Wan's RoPE tables), which a module built
    on the meta device holds empty: the live module's."""
    for name, part in built.named_modules():
        for attr, value in [*vars(part).items(), *part._buffers.items()]:
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(part, attr, getattr(live.get_submodule(name), attr).detach().clone())


def _as_built(buffer: torch.Tensor) -> torch.Tensor:
    """A copy of a live buffer for the float32 model `ema_model` builds (integer buffers keep their
    type)."""
    return buffer.detach().to(torch.float32 if buffer.is_floating_point() else buffer.dtype, copy=True)


class Sampler:
    """Samples at the steps `config.samples.due` names. Collective: every rank calls `after_step`.
    """

    def __init__(self, run: Run, progress: Any) -> None:
        cfg, accelerator = run.cfg, run.accelerator
        self.cfg, self.accelerator, self.model, self.frozen, self.family = cfg, accelerator, run.model, run.frozen, \
            run.family
        self.weights = run.eval_weights  # the weights to sample with (schedule-free AdamW's), collective
        self.tracker, self.progress = run.tracker, progress
        self.mesh = run.mesh
        self.enabled = bool(cfg.samples.enabled)
        self.ema = run.ema if cfg.samples.ema else None
        self.dir = run.run_dir / "samples"
        if not self.enabled:
            return
        if self.ema is not None and cfg.adapter.method.value != "none" and not text_encoders.enabled(cfg):
            # A LoRA's EMA holds the adapters only; sampling with it would need the frozen base
            # gathered too.
            log.warning("samples: adapter=%s samples with the trained adapters, not their EMA (the EMA LoRA is "
                        "exported to <run>/lora_ema)", cfg.adapter.method.value)
            self.ema = None
        # Rank 0 reads the prompts file: nodes could see different copies of it.
        self.prompts: list[str] = accel.from_main(
            accelerator, samples.prompts(cfg) if accelerator.is_main_process else None)
        self.settings = settings(cfg, self.family)
        self.units = [(i, int(seed)) for i in range(len(self.prompts)) for seed in cfg.samples.seeds]
        self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        """Ranks that would run different forwards under ZeRO-3 hang in a gather: fail now instead.
        """
        from accelerate.utils import gather_object

        s = self.cfg.samples
        mine = json.dumps({"settings": asdict(self.settings), "units": len(self.units), "every": int(s.every),
                           "at_end": bool(s.at_end), "max_steps": int(self.cfg.train.max_steps),
                           "ema": self.ema is not None}, sort_keys=True)
        everyone = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        if len(set(everyone)) > 1:
            raise TrainingError("samples: the ranks disagree on what to sample (their configurations differ: "
                                + " | ".join(f"rank {r}: {v}" for r, v in enumerate(everyone))
                                + "); launch every rank with the same overrides")

    def after_step(self, step: int, stopping: bool) -> None:
        """Sample if `step` is due (every rank decides the same); not when a stop request cut the
        run short."""
        if not samples.due(self.cfg, step) or (stopping and step < int(self.cfg.train.max_steps)):
            return
        if self.progress is not None:
            self.progress.set_description(f"sampling {len(self.units)} images")
            self.progress.refresh()
        start = time.perf_counter()
        mine, error = [], None
        with self.weights():
            try:
                mine = self._generate_share()
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it before the gather
                error = exc
        if accel.any_rank(self.accelerator, error is not None):
            raise TrainingError(f"sampling at step {step} failed on "
                                f"{'this' if error else 'another'} rank: {error or 'see its log'}") from error
        from accelerate.utils import gather_object

        gathered = gather_object(mine) if self.accelerator.num_processes > 1 else mine
        seconds = time.perf_counter() - start
        if self.accelerator.is_main_process:
            self._write(step, sorted(gathered, key=lambda item: (item[0], item[1])), seconds)
        if self.progress is not None:
            self.progress.set_description("train")
            self.progress.refresh()

    def _generate_share(self) -> list[tuple[int, int, Any]]:
        """This rank's images: units rank, rank + world, ...; every rank makes the same number of
        calls. Under parallel.context a context group makes its units together (its ranks' sequence
        parts meet in the attention), the group's first rank keeping them."""
        mesh = self.mesh
        rank, world = mesh.data_rank, mesh.data_world
        calls = math.ceil(len(self.units) / world)
        device = self.accelerator.device
        with self._sampling_model() as (model, encoders), self._frozen_on(device), plain_linear(), \
                torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            pipe = self._pipeline(model, encoders)
            out = []
            for k in range(calls):
                u = k * world + rank
                index, seed = self.units[u] if u < len(self.units) else self.units[0]  # padding: same work
                image = generate(pipe, self.prompts[index], seed, self.settings, reference(self.settings, index))
                if u < len(self.units) and mesh.context_rank == 0:
                    out.append((index, seed, image))
        return out

    @contextlib.contextmanager
    def _sampling_model(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """The UNet to sample with and the trained text encoders (none when they are frozen), in
        eval mode (their modes are restored afterwards). The casts are no-ops where dtypes already
        agree (a float32 UNet on the CPU); on a GPU the text encoders are bf16. With trained
        encoders the EMA's values are put into the trained module for the time of the samples
        (`EMA.applied`: UNet and encoders together, cast to the module's dtype)."""
        module = self.accelerator.unwrap_model(self.model)
        weights: list[contextlib.AbstractContextManager] = []
        if isinstance(module, text_encoders.Denoiser):
            model, encoders = module.unet, {name: getattr(module, name) for name in module.encoder_names}
            if self.ema is not None:
                weights.append(self.ema.applied(module))
            weights.append(sharded.gathered(module))  # FSDP2: the pipeline calls the parts one by one
        else:
            model = ema_model(self.accelerator, self.model, self.ema, "samples.ema") if self.ema is not None else module
            encoders = {}
        parts = [model, *encoders.values()]
        modes = [part.training for part in parts]
        for part in parts:
            part.eval()
        try:
            with contextlib.ExitStack() as held:
                for manager in [*weights, model_in_its_dtype(model), _vae_decode_in_its_dtype(self.frozen.vae)]:
                    held.enter_context(manager)
                yield model, encoders
        finally:
            for part, mode in zip(parts, modes, strict=True):
                part.train(mode)

    @contextlib.contextmanager
    def _frozen_on(self, device: torch.device) -> Iterator[None]:
        """The frozen encoders on the sampling device (training may have moved them to the CPU after
        caching)."""
        parts = self.frozen.modules()
        before = [next(p.parameters()).device for p in parts]
        for part in parts:
            quantize.move(part, device)  # an int8 encoder's LLM.int8 state with it
        try:
            yield
        finally:
            for part, where in zip(parts, before, strict=True):
                quantize.move(part, where)
            if device.type == "cuda" and any(where != device for where in before):
                torch.cuda.empty_cache()

    def _pipeline(self, model: Any, encoders: dict[str, Any]) -> Any:
        pipe = self.family.pipeline(self.cfg, self.frozen, {self.family.component: model, **encoders})
        pipe.set_progress_bar_config(disable=True)  # type: ignore[attr-defined]
        return pipe

    def _write(self, step: int, images: list[tuple[int, int, Any]], seconds: float) -> None:
        """Rank 0: PNGs (a video model's clips as mp4), the grid (a row per prompt, a column per
        seed; a video model's: a row per clip, a column per frame), the timing line and W&B."""
        folder = self.dir / f"step_{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        for index, seed, image in images:
            if isinstance(image, list):
                video.write(folder / f"{index}_{seed}.mp4", image, self._fps())
            else:
                image.save(folder / f"{index}_{seed}.png")
        clips = [image for _, _, image in images if isinstance(image, list)]
        if clips:  # a video model's: a row per clip, its frames left to right (lossless, unlike the mp4)
            _grid([frame for clip in clips for frame in clip], len(clips[0])).save(folder / "grid.png")
        else:
            _grid([image for _, _, image in images], len(self.cfg.samples.seeds)).save(folder / "grid.png")
        with (self.dir / "samples.jsonl").open("a") as file:
            file.write(json.dumps({"step": step, "seconds": seconds, "images": len(images)}) + "\n")
        log.info("sampled %d images at step %d in %.1fs: %s", len(images), step, seconds, folder)
        self._to_wandb(step, images, seconds)

    def _fps(self) -> float:
        """A video model's frame rate (model.video.fps): its clips are written at it."""
        return float(self.cfg.model.video.fps) if self.cfg.model.get("video") is not None else 16.0

    def _to_wandb(self, step: int, images: list[tuple[int, int, Any]], seconds: float) -> None:
        if not self.tracker.wandb_id or self.tracker.wandb_broken:
            return
        try:
            import wandb

            run = self.accelerator.get_tracker("wandb", unwrap=True)
            logged = [_to_wandb(wandb, image, f"{index}_{seed}: {self.prompts[index]}", self._fps())
                      for index, seed, image in images]
            run.log({"samples": logged, "sample_s": seconds}, step=step)
        except Exception as exc:  # noqa: BLE001 - W&B going away must not stop training
            log.warning("could not log samples to W&B (%s); they are in %s", exc, self.dir)


def _to_wandb(wandb: Any, image: Any, caption: str, fps: float) -> Any:
    """A sample as W&B logs it: an image, or a clip (its frames) as a video."""
    if not isinstance(image, list):
        return wandb.Image(image, caption=caption)
    import numpy as np

    frames = np.stack([np.asarray(frame.convert("RGB")) for frame in image]).transpose(0, 3, 1, 2)
    return wandb.Video(frames, caption=caption, fps=int(round(fps)), format="mp4")
