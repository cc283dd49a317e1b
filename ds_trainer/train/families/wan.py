"""Wan 2.1 and 2.2: WanTransformer3DModel trained by flow matching (train/flow.py) on
AutoencoderKLWan's latents of a clip (frames x height x width; an image is a clip of one frame),
normalised by the VAE's per-channel mean and deviation as WanPipeline denormalises them; the
transformer is given sigma * 1000 as its timestep. Captions: UMT5's last hidden state of the
caption's own tokens, zero past them up to `model.flow.text_max_length`, as WanPipeline encodes them
(cached in bf16).

What conditions it beside the caption (`model.video.condition`, as the pipelines build it):
- `clip_and_latents` (Wan 2.1 I2V): the first frame's CLIP image tokens (the vision tower's
  penultimate layer), and as input channels a mask (1 on the first latent frame) and the VAE's
  latents of the first frame followed by empty frames (WanImageToVideoPipeline.prepare_latents),
  both cached;
- `latents` (Wan 2.2 I2V A14B): the mask and those latents, no CLIP;
- `first_frame` (Wan 2.2 TI2V-5B): the clip's first latent frame is given clean, its tokens at
  timestep 0 (the pipeline's expand_timesteps), and the loss is on the other frames.

A two-expert model (Wan 2.2 A14B, `model.video.boundary`): the expert `model.video.expert` trains,
on the timesteps it serves alone (the schedule's table cut at the boundary: high, sigma >= boundary;
low, below); the other expert, frozen, joins it in the pipeline that samples and is exported (the
trained one in its slot: the low-noise expert is the pipeline's transformer_2): the source's, or
`model.video.other_expert` (a trained transformer, or a LoRA merged into the source's). `both`
trains them one after the other, each in a run of its own (the spec's phases: config/phases.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.families.wan import SPEC
from ds_trainer.train.families import common, flow
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.families.common import per_sample_mse
from ds_trainer.train.families.flow_family import FlowFamily, FrozenParts
from ds_trainer.train.layouts import wan as wan_layout
from ds_trainer.train.layouts.table import Part

log = logging.getLogger("ds_trainer")
# The text tokens WanImageToVideoPipeline's attention takes the image tokens after (its processor
# cuts there).
I2V_TEXT_TOKENS = 512


@dataclass
class Frozen(FrozenParts):
    ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "image_encoder")
    vae: Any  # AutoencoderKLWan
    text_encoder: Any  # UMT5EncoderModel
    tokenizer: Any
    image_encoder: Any = None  # CLIPVisionModel (Wan 2.1 I2V)
    image_processor: Any = None


def first_frame_mask(latents: torch.Tensor, channels: int = 4) -> torch.Tensor:
    """WanImageToVideoPipeline's mask: `channels` (the VAE's time compression) ones on the first
    latent frame, zeros on the others, shaped as the latents (B, channels, F, H, W)."""
    b, _, f, h, w = latents.shape
    mask = torch.zeros(b, channels, f, h, w, dtype=latents.dtype, device=latents.device)
    mask[:, :, 0] = 1
    return mask


def _pictures(pixels: torch.Tensor) -> list[Any]:
    """Frames in [-1, 1] (B, 3, H, W) as the PIL pictures the CLIP processor is given."""
    from PIL import Image

    values = (
        ((pixels.float().cpu() + 1) * 127.5)
        .round()
        .clamp(0, 255)
        .to(torch.uint8)
        .permute(0, 2, 3, 1)
    )
    return [Image.fromarray(v.numpy()) for v in values]


class Wan(FlowFamily):
    spec = SPEC
    name = SPEC.name
    sequence_encoder = "UMT5"

    def __init__(self, cfg: DictConfig | None = None) -> None:
        f = cfg.model.flow if cfg is not None else None
        video = cfg.model.get("video") if cfg is not None else None
        self._text_length = int(f.text_max_length) if f is not None else I2V_TEXT_TOKENS
        self.condition = str(video.condition.value) if video is not None else "none"
        self.boundary = None if video is None or video.boundary is None else float(video.boundary)
        self.expert = str(video.expert.value) if video is not None else "high"
        self.fps = float(video.fps) if video is not None else 16.0
        self._frames = _sample_frames(cfg) if cfg is not None else 17

    # The parts
    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

        console.adopt()
        path, kwargs = common.source(cfg)
        clip = self.condition == "clip_and_latents"
        with whole():
            tokenizer = AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs)
            if cfg.model.pretrained:
                vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", **kwargs)
                encoder = UMT5EncoderModel.from_pretrained(path, subfolder="text_encoder", **kwargs)
            else:
                torch.manual_seed(int(cfg.train.seed))
                vae = AutoencoderKLWan.from_config(
                    AutoencoderKLWan.load_config(path, subfolder="vae")
                )
                encoder = UMT5EncoderModel(
                    UMT5Config.from_pretrained(path, subfolder="text_encoder")
                )
            image_encoder, processor = (
                self._image_encoder(cfg, path, kwargs) if clip else (None, None)
            )
        for module in (vae, encoder, image_encoder):
            if module is not None:
                module.requires_grad_(False)
                module.eval()
        return Frozen(vae, encoder, tokenizer, image_encoder, processor)

    @staticmethod
    def _image_encoder(cfg: DictConfig, path: str, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Wan 2.1 I2V's CLIP vision tower and its processor (PIL's: no torchvision needed)."""
        from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

        revision = {k: v for k, v in kwargs.items() if k == "revision"}
        processor = CLIPImageProcessorPil.from_pretrained(
            path, subfolder="image_processor", **revision
        )
        if cfg.model.pretrained:
            return CLIPVisionModel.from_pretrained(
                path, subfolder="image_encoder", **kwargs
            ), processor
        return CLIPVisionModel(
            CLIPVisionConfig.from_pretrained(path, subfolder="image_encoder")
        ), processor

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import WanTransformer3DModel

        if self.boundary is not None:
            side = "at or above" if self.expert == "high" else "below"
            other = cfg.model.video.get("other_expert") or "the source's"
            log.info("%s trains its %s-noise expert (the pipeline's %s) on the timesteps whose "
                     "sigma is %s %g; the other expert is %s, frozen, in the samples and the "
                     "exported pipeline", cfg.model.name, self.expert, self._trained_folder(),
                     side, self.boundary, other)
        return common.trained_module(  # type: ignore[no-any-return]
            cfg, WanTransformer3DModel, self._trained_folder(), cfg.model.get("transformer")
        )

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import WanTransformer3DModel

        return common.meta_module(cfg, WanTransformer3DModel, self._trained_folder())

    def _trained_folder(self) -> str:
        """The pipeline's folder of the trained transformer (A14B's low-noise expert:
        transformer_2)."""
        return (
            "transformer_2" if self.boundary is not None and self.expert == "low" else "transformer"
        )

    # Encoding
    @torch.no_grad()
    def encode_images(self, frozen: Frozen, pixels: torch.Tensor) -> torch.Tensor:
        """Clips in [-1, 1] (B, 3, F, H, W; an image is F=1) to the VAE's normalised latents (its
        mean)."""
        return _normalised(
            frozen.vae, frozen.vae.encode(_on_vae(frozen.vae, pixels)).latent_dist.mean
        )

    @torch.no_grad()
    def conditioning(self, frozen: Frozen, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the clip gives its model beside its latents (cached with them): the first frame's
        latents after empty frames and, for Wan 2.1 I2V, its CLIP tokens."""
        if self.condition not in ("clip_and_latents", "latents"):
            return {}
        first = pixels[:, :, :1]
        video = torch.cat(
            [first, first.new_zeros(*first.shape[:2], pixels.shape[2] - 1, *first.shape[3:])], dim=2
        )
        out = {
            "condition_latents": _normalised(
                frozen.vae, frozen.vae.encode(_on_vae(frozen.vae, video)).latent_dist.mode()
            )
        }
        if self.condition == "clip_and_latents":
            encoder = frozen.image_encoder
            inputs = frozen.image_processor(images=_pictures(first[:, :, 0]), return_tensors="pt")
            inputs = inputs.to(encoder.device)
            out["image_embeds"] = encoder(**inputs, output_hidden_states=True).hidden_states[-2]
        return out

    def storage_dtype(self, key: str) -> torch.dtype | None:
        return torch.bfloat16 if key in ("prompt_embeds", "image_embeds") else None

    @torch.no_grad()
    def text_inputs(
        self,
        frozen: Frozen,
        prompts: list[str],
        device: torch.device,
        references: torch.Tensor | None = None,  # noqa: ARG002 - the Family protocol's signature
    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds`: UMT5's states of each cleaned caption's own tokens, zeros after them
        (WanPipeline's)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = frozen.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=self._text_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.to(device)
        states = frozen.text_encoder(inputs.input_ids.to(device), mask).last_hidden_state
        return {"prompt_embeds": states * mask.gt(0)[..., None].to(states.dtype)}

    def text_parts(self, frozen: Frozen) -> TextParts:  # noqa: ARG002 - the protocol's signature
        """UMT5 makes the whole sequence."""
        return {"t5": [("prompt_embeds", (slice(None), slice(None)))]}

    # Training
    def schedule(self, cfg: DictConfig) -> flow.Schedule:
        """The flow schedule; for one expert of two, its share of the table alone (the high-noise
        expert's sigmas at or above the boundary, the low-noise one's below), so draws and
        validation stay in its range."""
        whole = flow.Schedule.of(cfg)
        if self.boundary is None or self.expert == "both":  # both: each phase its own
            return whole
        high = whole.sigmas >= self.boundary
        kept = whole.sigmas[high] if self.expert == "high" else whole.sigmas[~high]
        return dataclasses.replace(whole, sigmas=kept)

    def losses(
        self,
        model: Any,
        schedule: flow.Schedule,
        batch: dict[str, torch.Tensor],
        noise: torch.Tensor,
        t: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        latents = batch["latents"]
        sigma = schedule.sigma(t)
        noisy = flow.noisy(latents, noise, sigma)
        timestep = (sigma * 1000).to(device)
        extra: dict[str, Any] = {}
        frames_scored = slice(None)
        if (
            self.condition == "first_frame" and latents.shape[2] > 1
        ):  # TI2V: the first latent frame clean, its
            # tokens at timestep 0 (an image, one frame, trains as text to image)
            noisy = torch.cat([latents[:, :, :1], noisy[:, :, 1:]], dim=2)
            timestep = _token_timesteps(latents, timestep)
            frames_scored = slice(1, None)
        elif self.condition in ("clip_and_latents", "latents"):
            condition = batch["condition_latents"].to(noisy.dtype)
            noisy = torch.cat([noisy, first_frame_mask(condition), condition], dim=1)
            if self.condition == "clip_and_latents":
                extra["encoder_hidden_states_image"] = batch["image_embeds"].to(device, dtype)
        pred = model(
            hidden_states=noisy.to(device, dtype),
            timestep=timestep,
            encoder_hidden_states=batch["prompt_embeds"].to(device, dtype),
            return_dict=False,
            **extra,
        )[0]
        target = flow.target(latents, noise)
        weight = batch.get("weight_map")
        if weight is not None:
            weight = weight.expand_as(latents)[:, :, frames_scored]
        return per_sample_mse(pred[:, :, frames_scored], target[:, :, frames_scored], weight)

    # The pipeline
    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import UniPCMultistepScheduler

        path, kwargs = common.source(cfg)
        model = (
            trained["transformer"] if "transformer" in trained else self.load_trained(cfg).eval()
        )
        slots = {"transformer": model}
        if self.boundary is not None:  # the other expert (a base pipeline's: the source's)
            other = "transformer" if self._trained_folder() == "transformer_2" else "transformer_2"
            partner = self.other_expert(cfg, other, given="transformer" in trained)
            slots = {self._trained_folder(): model, other: _inputs_in_its_dtype(partner)}
        parts = {
            "vae": frozen.vae,
            "text_encoder": frozen.text_encoder,
            "tokenizer": frozen.tokenizer,
            "scheduler": UniPCMultistepScheduler.from_pretrained(
                path, subfolder="scheduler", **kwargs
            ),
            **slots,
            "boundary_ratio": self.boundary,
            "expand_timesteps": self.condition == "first_frame",
        }
        if self.condition == "clip_and_latents":
            parts.update(image_encoder=frozen.image_encoder, image_processor=frozen.image_processor)
        return self._pipeline_class()(**parts)

    def other_expert(self, cfg: DictConfig, folder: str, given: bool = True) -> Any:
        """The expert in the pipeline's `folder` that does not train, frozen: with `given`,
        `model.video.other_expert` (a trained transformer folder, or a LoRA merged into the
        source's expert), else the source's (a base pipeline's, which a LoRA file loads into)."""
        from diffusers import WanTransformer3DModel

        path, kwargs = common.source(cfg)
        other = cfg.model.video.get("other_expert") if given else None
        if other and (Path(other) / "config.json").is_file():
            return WanTransformer3DModel.from_pretrained(other, torch_dtype=torch.float32).eval()
        if cfg.model.pretrained:
            model = WanTransformer3DModel.from_pretrained(path, subfolder=folder, **kwargs)
        else:  # a tiny model's experts: random, fixed by the seed, as `load_trained` builds them
            torch.manual_seed(int(cfg.train.seed))
            model = WanTransformer3DModel.from_config(
                WanTransformer3DModel.load_config(path, subfolder=folder)
            )
        if other:  # a LoRA of this expert (its diffusers-layout file), merged into the source's
            file = Path(other)
            if file.is_dir():
                file = file / "pytorch_lora_weights.safetensors"
            model.load_lora_adapter(str(file), prefix="transformer", adapter_name="other_expert")
            model.fuse_lora(adapter_names=["other_expert"])
            model.unload_lora()
        return model.eval()

    def _pipeline_class(self) -> Any:
        """WanImageToVideoPipeline for a model given the first frame, else WanPipeline."""
        from diffusers import WanImageToVideoPipeline, WanPipeline

        return WanPipeline if self.condition == "none" else WanImageToVideoPipeline

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:  # noqa: ARG002 - the protocol's
        return {
            "max_sequence_length": self._text_length,
            "num_frames": self._frames,
            "output_type": "pil",
        }

    def guidance_kwargs(self, scale: float, negative: str) -> dict[str, Any]:
        """Classifier-free guidance at `scale` against the negative prompt (empty: UMT5's empty
        caption); both experts of A14B at the same scale."""
        return {"guidance_scale": scale, "negative_prompt": negative or None}

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        """A clip's latents (frames by the VAE's 4x, space by the model's downsampling over the
        patch's 2), the caption's tokens; an image to video model's channels and CLIP tokens."""
        c, b, factor = model.config, shape.batch, shape.downsample // 2
        frames = (shape.frames - 1) // SPEC.temporal_factor + 1
        latents = (b, int(c.in_channels), frames, shape.height // factor, shape.width // factor)
        inputs = {"hidden_states": torch.randn(*latents, **shape.tensors),
                  "timestep": torch.rand(b, device=shape.device) * 1000,
                  "encoder_hidden_states": torch.randn(b, shape.tokens, int(c.text_dim),
                                                       **shape.tensors)}
        if c.image_dim:  # Wan 2.1 I2V: CLIP ViT-H's 257 tokens
            image = torch.randn(b, 257, int(c.image_dim), **shape.tensors)
            inputs["encoder_hidden_states_image"] = image
        return lambda: model(**inputs)

    def planner_blocks(self) -> tuple[type, ...]:
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        return (WanTransformerBlock,)

    def lora_pipeline(self) -> Any:
        """WanPipeline's LoRA file (WanImageToVideoPipeline reads the same; A14B's low-noise expert
        loads it with load_into_transformer_2=True)."""
        from diffusers import WanPipeline

        return WanPipeline

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        """The original Wan names (ComfyUI's split_files/diffusion_models files)."""
        return wan_layout.tensors(denoiser)

    def kohya_parts(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        config: Any,  # noqa: ARG002 - the Family protocol's signature
    ) -> list[Part]:
        """musubi-tuner's names (`lora_unet_blocks_0_self_attn_q`), the original modules', which
        ComfyUI reads."""
        return wan_layout.parts(shapes)


def _inputs_in_its_dtype(model: Any) -> Any:
    """A frozen expert that takes its inputs in its own dtype: WanPipeline hands both experts the
    first one's (a 16-bit trained high-noise expert's, as DeepSpeed samples it); the timestep as
    given."""
    dtype = model.patch_embedding.weight.dtype

    def cast(value: Any) -> Any:
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    def before(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:  # noqa: ARG001
        given = {k: v if k == "timestep" else cast(v) for k, v in kwargs.items()}
        return tuple(cast(a) if i != 1 else a for i, a in enumerate(args)), given

    model.register_forward_pre_hook(before, with_kwargs=True)
    return model


def _on_vae(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels as the VAE takes them: 5-D (B, 3, F, H, W), on its device, in its dtype."""
    return (pixels if pixels.ndim == 5 else pixels[:, :, None]).to(vae.device, vae.dtype)


def _normalised(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """(z - mean) / std per channel (WanPipeline decodes latents * std + mean)."""
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
    std = torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
    return ((latents.float() - mean) / std).to(latents.dtype)


def _token_timesteps(latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """TI2V's timestep per token (B, F * H/2 * W/2): 0 on the first latent frame's tokens, the
    sample's elsewhere (the pipeline's `(mask[0][0][:, ::2, ::2] * t).flatten()`)."""
    b, _, f, h, w = latents.shape
    per_frame = torch.ones(f, h // 2, w // 2, device=timestep.device)
    per_frame[0] = 0
    return per_frame.flatten()[None] * timestep.view(b, 1)


def _sample_frames(cfg: DictConfig) -> int:
    """The frames of a sample clip: samples.frames, else the most data.video.frames trains at."""
    frames = cfg.samples.get("frames") if cfg.get("samples") is not None else None
    return int(frames) if frames else max(int(n) for n in cfg.data.video.frames)
