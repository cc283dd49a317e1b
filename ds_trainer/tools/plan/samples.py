"""The planner's part for `samples=on` and `validation=on`: the peak GPU memory per rank while sampling or
validating (the larger), beside training's. Validating holds what training holds between steps, with the EMA
scored its float32 UNet, and a forward's working set over `validation.batch_size` pairs (no encoders, no VAE).

Sampling holds what training holds between steps (parameters, gradients, optimizer state, DeepSpeed's
buffers), plus:
- the frozen VAE and text encoders on the GPU (after caching, training moves them to the CPU; sampling
  brings them back), in the dtypes training loads them with;
- with `train.ema` and `samples.ema`, a float32 UNet on the EMA shadow (none extra with
  `train.ema_device=gpu`: it is the shadow itself);
- the larger of the UNet's inference working set (a batch of 2 with classifier-free guidance) and the
  VAE decode's. Counted on the meta device: the largest (inputs + outputs) of any layer, plus what the
  UNet keeps for its skip connections (the down blocks' outputs). Nothing is kept for backward.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.tools.plan import quantized
from ds_trainer.tools.plan.unet import text_tokens, token_height

GIB = 2**30


def _bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    return int(_bytes(value.sample)) if hasattr(value, "sample") else 0


def _working_set(module: Any, run: Any, held_in: list[Any]) -> int:
    """Largest (inputs + outputs) of a leaf module during `run()`, plus the outputs of `held_in` modules."""
    largest, held = [0], [0]

    def leaf(m: Any, args: Any, out: Any) -> None:  # noqa: ARG001 - torch's hook signature
        largest[0] = max(largest[0], _bytes(args) + _bytes(out))

    def keep(m: Any, args: Any, out: Any) -> None:  # noqa: ARG001 - torch's hook signature
        held[0] += _bytes(out)

    leaves = [m for m in module.modules() if not list(m.children())]
    handles = [m.register_forward_hook(leaf) for m in leaves] + [m.register_forward_hook(keep) for m in held_in]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return largest[0] + held[0]


@cache
@cache  # a function of its arguments (a meta-device forward): the tuner and the plan table ask again and again
def _activations(  # noqa: PLR0913 - the cache's key, one argument each
        architecture: str, width: int, height: int, batch: int, dtype_bytes: int,
        tokens: int = 77, frames: int = 0, downsample: int = 8) -> int:
    """The working set of a forward without gradients and of the VAE's decode; `frames`: a video
    model's clip of that many frames (0: an image model's image)."""
    import torch
    from diffusers import AutoencoderKL

    from ds_trainer.tools.plan.unet import forward_of, meta_unet

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    unet = meta_unet(architecture).to(dtype)
    with torch.device("meta"), torch.no_grad():
        forward = forward_of(unet, batch, height, width, dtype, tokens=tokens,
                             frames=max(1, frames), downsample=downsample)
        # A UNet keeps its down blocks' outputs for the skip connections; a transformer keeps nothing across blocks.
        unet_peak = _working_set(unet, forward, [unet.conv_in, *unet.down_blocks] if hasattr(unet, "down_blocks")
                                 else [])
        if frames:
            return max(unet_peak, _clip_decode(architecture, width, height, frames))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(architecture, subfolder="vae"))
        latents = torch.randn(1, int(vae.config.latent_channels), height // 8, width // 8)
        vae_peak = _working_set(vae, lambda: vae.decode(latents), [])
    return max(unet_peak, vae_peak)


def _clip_decode(architecture: str, width: int, height: int, frames: int) -> int:
    """A video model's VAE (its own class, a causal 3D one) decoding one clip's latents: the
    working set of its decode, frame by latent frame as it runs."""
    import diffusers
    import torch

    config = diffusers.AutoencoderKL.load_config(architecture, subfolder="vae")
    vae = getattr(diffusers, str(config["_class_name"])).from_config(config)
    c = vae.config
    space, time = int(c.get("scale_factor_spatial", 8)), int(c.get("scale_factor_temporal", 4))
    latent_frames = (frames - 1) // time + 1
    latents = torch.randn(1, int(c.z_dim), latent_frames, height // space, width // space)
    return _working_set(vae, lambda: vae.decode(latents), [])


@cache
def encoders_quantized(cfg: DictConfig) -> str:
    """How the frozen text encoders are held: `quantize.kind` when `quantize.text_encoders`, else none."""
    q = cfg.get("quantize")
    return q.kind.value if q is not None and q.text_encoders else "none"


def frozen_bytes(architecture: str, kind: str, precision: str = "bf16", vae: bool = True,
                 quantize: str = "none") -> int:
    """The VAE (unless `vae` is False) and the text encoders (SDXL's two CLIPs; SD3's two and T5; Flux's CLIP-L and
    T5; Qwen-Image's Qwen2.5-VL) as training loads them (in the precision's dtype on a GPU, float32 on the CPU; the
    VAE in float32 when its config asks); the encoders' linear layers quantized with `quantize=int8|nf4`."""
    import diffusers
    import torch

    config = diffusers.AutoencoderKL.load_config(architecture, subfolder="vae")
    with torch.device("meta"):  # AutoencoderKL, or Qwen-Image's video VAE
        autoencoder = getattr(diffusers, str(config.get("_class_name", "AutoencoderKL"))).from_config(config)
        encoders = [_encoder(architecture, name) for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
                    if (Path(architecture) / name).is_dir()]
    half = 4 if kind == "cpu" or precision == "fp32" else 2
    vae_bytes = 4 if autoencoder.config.get("force_upcast") or kind == "cpu" else half
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    fewer = sum(quantized.saved(quantize, quantized.linear_layers(e), half) for e in encoders)
    return (count(autoencoder) * vae_bytes if vae else 0) + sum(count(e) for e in encoders) * half - fewer


def _encoder(architecture: str, name: str) -> Any:
    """A text encoder of the folder on the meta device, by its config: T5 (SD3's third, Flux's second), Qwen2.5-VL
    (Qwen-Image's, its vision tower too), another by the class its config names (Wan's UMT5,
    Z-Image's Qwen3) or CLIP, with the projection where its config names that class (SDXL's second,
    SD3's first two)."""
    import torch
    import transformers
    from transformers import (
        AutoConfig,
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        PretrainedConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        T5Config,
        T5EncoderModel,
    )

    found, _ = PretrainedConfig.get_config_dict(architecture, subfolder=name)
    with torch.device("meta"):
        if found.get("model_type") == "t5":
            return T5EncoderModel(T5Config.from_pretrained(architecture, subfolder=name))
        if found.get("model_type") == "qwen2_5_vl":
            return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_pretrained(architecture, subfolder=name))
        named = (found.get("architectures") or [""])[0]
        if not str(found.get("model_type")).startswith("clip") and hasattr(transformers, named):
            # another encoder by the class its config names (UMT5, Qwen3, Mistral 3), not as CLIP
            config = AutoConfig.from_pretrained(architecture, subfolder=name)
            return getattr(transformers, named)(config)
        projected = "CLIPTextModelWithProjection" in (found.get("architectures") or []) or name == "text_encoder_2"
        cls = CLIPTextModelWithProjection if projected else CLIPTextModel
        return cls(CLIPTextConfig.from_pretrained(architecture, subfolder=name))


def peak(cfg: DictConfig, resident: int, unet_params: int, architecture: str, kind: str = "cuda") -> int | None:
    """Peak GPU bytes per rank while sampling or validating, the larger (None with samples=none and
    validation=none); `resident` is what training keeps between steps (parameters, gradients, optimizer state,
    buffers)."""
    peaks = [p for p in (_sampling(cfg, resident, unet_params, architecture, kind),
                         _validation(cfg, resident, unet_params, architecture)) if p is not None]
    return max(peaks) if peaks else None


def _validation(cfg: DictConfig, resident: int, unet_params: int, architecture: str) -> int | None:
    """validation=on: a forward without gradients over `validation.batch_size` pairs at the training size, and with
    the EMA scored, its float32 UNet (the encoders are not needed: the set was encoded at the start)."""
    if not cfg.validation.enabled:
        return None
    from ds_trainer.config import buckets

    width, height = buckets.largest(cfg)
    height = token_height(cfg, height)
    batch = int(cfg.validation.batch_size) or int(cfg.train.micro_batch_size)
    ema = 4 * unet_params if cfg.train.ema and cfg.validation.ema and cfg.adapter.method.value == "none" else 0
    dtype_bytes = 4 if cfg.precision.name.value == "fp32" or ema else 2
    clip = _clip(cfg, max(int(n) for n in cfg.data.video.frames))
    return resident + ema + _activations(architecture, width, height, batch, dtype_bytes,
                                         text_tokens(cfg), *clip)


def _clip(cfg: DictConfig, frames: int) -> tuple[int, int]:
    """A video model's (frames, downsample factor) for `_activations`; (0, 8) for an image model."""
    from ds_trainer.config import families

    return (frames, int(cfg.model.downsample_factor)) if families.of(cfg).video else (0, 8)


def _sampling(cfg: DictConfig, resident: int, unet_params: int, architecture: str, kind: str) -> int | None:
    if not cfg.samples.enabled:
        return None
    from ds_trainer.config import samples

    width, height = samples.size(cfg)
    height = token_height(cfg, height)
    batch = 2 if float(cfg.samples.guidance_scale) > 1 else 1
    # DDP's module keeps its fp32 weights and the sampler runs no autocast: it samples in fp32 whatever the precision
    fp32 = cfg.precision.name.value == "fp32" or cfg.zero.backend.value == "ddp"
    dtype_bytes = 4 if fp32 else 2
    ema = 4 * unet_params if cfg.train.ema and cfg.samples.ema else 0  # the whole EMA UNet, gathered to sample
    if ema:
        dtype_bytes = 4  # the EMA UNet samples in float32
    frozen = frozen_bytes(architecture, kind, cfg.precision.name.value, quantize=encoders_quantized(cfg))
    frames = cfg.samples.get("frames") or max(int(n) for n in cfg.data.video.frames)
    return resident + frozen + ema + _activations(architecture, width, height, batch, dtype_bytes,
                                                  text_tokens(cfg), *_clip(cfg, int(frames)))


def describe(sampling: int, training: int) -> str:
    """One line: the sampling or validation peak, and whether it is above training's."""
    above = sampling > training
    return (f"sampling/validation peaks at about {sampling / GIB:.2f} GiB per rank, "
            + (f"{(sampling - training) / GIB:.2f} GiB above training's {training / GIB:.2f} GiB" if above
               else f"within training's {training / GIB:.2f} GiB"))
