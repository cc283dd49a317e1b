"""The schemas of what a run reads: the `model` group (its family, flow matching, weights, facts)
and the `data` group (its sources, captions, buckets, cache), torch-free; config/schema.py
re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from ds_trainer.config.choices import (
    DataSource,
    Expert,
    FrameExtraction,
    LossWeighting,
    ModelFamily,
    Remainder,
    SourceKind,
    TimestepDensity,
    VideoCondition,
)

# Pillow's own limit against decompression bombs (its DecompressionBombError: twice
# Image.MAX_IMAGE_PIXELS, 89,478,485): data.max_image_pixels' default.
PILLOW_PIXELS = 178_956_970


@dataclass
class FlowConfig:
    """`model.flow`: the flow-matching training of a diffusion transformer (SD3's family). A
    sample's noise level sigma is drawn as u from `density` (`logit_normal`: sigmoid of
    N(logit_mean, logit_std), the SD3 paper's; `mode` with `mode_scale`; `uniform`), looked up in
    the 1000-entry table sigma_i = (1000 - i) / 1000 shifted by `shift` (shift * s / (1 + (shift -
    1) * s): SD3's 3.0 favours noisier steps), the latents noised as (1 - sigma) x0 + sigma noise
    and the transformer's prediction compared with noise - x0, weighted by `weighting` (`none`;
    `sigma_sqrt`: 1/sigma^2; `cosmap`: 2 / (pi (1 - 2 sigma + 2 sigma^2)))."""

    # How a sample's u (its noise level's place in the table) is drawn: SD3's paper and diffusers'
    # SD3 script use
    # logit_normal.
    density: TimestepDensity = TimestepDensity.logit_normal
    # logit_normal: u = sigmoid(N(logit_mean, logit_std)).
    logit_mean: float = 0.0
    logit_std: float = 1.0
    # mode: u = 1 - v - mode_scale (cos(pi v / 2)^2 - 1 + v) for v uniform.
    mode_scale: float = 1.29
    # The per-sample loss weight: none, sigma_sqrt (1/sigma^2), cosmap.
    weighting: LossWeighting = LossWeighting.none
    # sigma' = shift sigma / (1 + (shift - 1) sigma) on the table (SD3: 3.0; 1.0: no shift).
    shift: float = 3.0
    # Flux's resolution-dependent shift instead of `shift` (which must then be 1.0): mu = 0.5 at 256
    # image tokens to
    # 1.15 at 4096, linear in between and beyond, and sigma' = e^mu / (e^mu + 1/sigma - 1), as its
    # sampler shifts.
    dynamic_shift: bool = False
    # The guidance a guidance-distilled transformer (Flux.1-dev: guidance_embeds) is given in
    # training (diffusers'
    # Flux scripts: 3.5; 1.0 is also used); null for a model without that input.
    guidance: float | None = None
    # Tokens of T5 per caption (the pipeline's max_sequence_length; SD3's own default is 256).
    t5_max_length: int = 256
    # Qwen-Image: tokens of Qwen2.5-VL's hidden states per caption after the template's system
    # prefix (the
    # pipeline's max_sequence_length: 512 by default, at most 1024).
    text_max_length: int = 512


@dataclass
class ModelAbout:
    """`model.about`: what a model option is, for the model card and the exported files' headers
    (nothing trains by it; the latent cache's key leaves it out)."""

    # random weights built offline (ds_trainer/assets): exports the whole pipeline

    tiny: bool = False
    base_id: str | None = None  # the base model's hub id (the card's base_model)
    license: str | None = None  # as the hub names it ("apache-2.0", "other")
    license_name: str | None = None  # the hub's license_name where license is "other"
    license_url: str | None = None
    # modelspec.architecture (null: the family's, config/families/)
    modelspec_architecture: str | None = None
    kohya_base_version: str | None = None  # kohya's ss_base_model_version (null: the family's)


@dataclass
class VideoModelConfig:
    """`model.video`: a video model's own settings (its family's spec says it trains on clips;
    null for an image model)."""

    # The frame rate the model was trained at (Wan 2.1: 16, Wan 2.2 TI2V: 24): clips are read at it
    # (data.video.resample) and its samples written at it.
    fps: float = 16.0
    # What it is given beside the caption: none (text to video), clip_and_latents (Wan 2.1 I2V: the
    # first frame's CLIP tokens and latents), latents (Wan 2.2 I2V: its latents), first_frame (Wan
    # 2.2 TI2V: the clean first latent frame, its tokens at timestep 0).
    condition: VideoCondition = VideoCondition.none
    # A model of two experts (Wan 2.2 A14B): the share of the 1000 timesteps above which the
    # high-noise expert denoises (the pipeline's boundary_ratio: 0.875 T2V, 0.9 I2V), and which
    # expert trains (its timesteps alone are drawn; both: the high-noise one, then the low-noise
    # one, each in a phase of its own, <run>/experts/high and low); null for one transformer.
    boundary: float | None = None
    expert: Expert = Expert.high
    # The expert that does not train, in the samples and the exported pipeline: null, the source's;
    # a diffusers transformer folder (a full fine-tune's <run>/transformer), or a diffusers-layout
    # LoRA folder (<run>/lora) on the source's expert. expert=both's low-noise phase sets it to
    # the high-noise phase's.
    other_expert: str | None = None


@dataclass
class ModelConfig:
    """`model` group: which model to train, of which family (`sdxl`: a UNet; `sd3`: SD3/SD3.5's
    MMDiT, `flux`: Flux.1's transformer, both trained by flow matching, which `flow` sets).

    `param_count`, `max_param_numel` and `downsample_factor` describe the trained module (UNet or
    transformer) so the torch-free config checks can size NVMe buffers and swap and check
    resolutions (the VAE's factor times the transformer's patch); a test checks them against the
    built model."""

    name: str = MISSING
    # What the model is: its frozen parts and how they encode, its trained module, loss, pipeline
    # (ds_trainer/families).
    family: ModelFamily = ModelFamily["sdxl"]  # type: ignore[valid-type]
    # The sd3 family's flow-matching training (null for SDXL): its keys below.
    flow: FlowConfig | None = None
    # A local diffusers folder, a hub id, or a single-file SDXL checkpoint (.safetensors/.ckpt,
    # original
    # layout; `architecture` gives its configs); None builds the architecture in `architecture`.
    pretrained: str | None = None
    revision: str | None = None
    variant: str | None = None
    # A VAE to use instead of the model's: a diffusers folder or a single .safetensors/.ckpt file.
    vae: str | None = None
    # SD3/SD3.5 and Flux: the trained transformer from one .safetensors file in its makers' layout
    # (Stability's
    # sd3.5_medium.safetensors, Black Forest Labs' flux1-dev.safetensors, a fine-tune shared that
    # way) instead of
    # `pretrained`'s; the rest (VAE, text encoders) comes from `pretrained` (or the architecture
    # when null).
    transformer: str | None = None
    # Folder of diffusers/transformers configs kept in the repo (ds_trainer/assets/<name>).
    architecture: str = MISSING
    # An editing model (Flux.1 Kontext): each image trains beside its reference (control) image,
    # whose latents are
    # appended to its tokens; the data pairs the images by name (data.control_path, a source's
    # control_path or
    # control_column), samples take samples.images.
    reference_images: bool = False
    # The most reference images a sample may have (Qwen-Image-Edit-2509/2511: 3, numbered
    # <name>_0, <name>_1, ... in the control folder, or a table cell's list); more than 1 selects
    # its family's several-reference layout (QwenImageEditPlusPipeline's).
    references: int = 1
    # A video model's own settings (frame rate, what conditions it, its experts): VideoModelConfig.
    video: VideoModelConfig | None = None
    about: ModelAbout = field(default_factory=ModelAbout)
    param_count: int = MISSING
    max_param_numel: int = MISSING
    downsample_factor: int = MISSING
    # The trained module's repeated blocks: FSDP's units (zero.fsdp_wrap follows them), the
    # planner's checkpointed
    # layers. SDXL's UNet: its attention and ResNet blocks; SD3's transformer:
    # JointTransformerBlock.
    blocks: list[str] = field(default_factory=lambda: ["BasicTransformerBlock", "ResnetBlock2D"])
    # train.compile=blocks: the blocks compiled one by one, each class's instances sharing its
    # compiled code (diffusers'
    # `_repeated_blocks`). SDXL: its transformer blocks only (its ResNet blocks change width at each
    # level, and every
    # width would compile again).
    compile_blocks: list[str] = field(default_factory=lambda: ["BasicTransformerBlock"])


@dataclass
class EncoderDropout:
    """data.text_encoder_dropout: per text encoder, the probability that its output is dropped
    (zeros) for a sample."""

    clip_l: float = 0.0
    clip_g: float = 0.0
    t5: float = 0.0
    # Qwen-Image's one encoder: refused (data.caption_dropout drops its caption)
    qwen_vl: float = 0.0


@dataclass
class SourceConfig:
    """One entry of `data.sources` (data=sources)."""

    path: str = MISSING
    kind: SourceKind = SourceKind.auto
    # its name in the log, summary.json and the sweep report (default: the path's last part)
    name: str | None = None
    # Times each of its images is seen an epoch (3 beside another source's 1: three times as often).
    # A fraction weighs a
    # source down (0.5: each image every other epoch); the epoch is then the passes that see every
    # source whole.
    repeats: float = 1
    # this source's probability of an empty caption (default data.caption_dropout)
    caption_dropout: float | None = None
    # This source's tag policy (default: data.tag_shuffle, data.keep_tokens, data.tag_dropout).
    tag_shuffle: bool | None = None
    keep_tokens: int | None = None
    tag_dropout: float | None = None
    # folder: the caption files' extension; webdataset: the caption member's
    caption_ext: str = "txt"
    # table, hf: the column of image paths or bytes (default image, file_name, path)
    image_column: str | None = None
    # table, hf: the captions' column (default text, caption, prompt)
    caption_column: str | None = None
    split: str = "train"  # hf: the split of a saved DatasetDict
    # The side of its buckets' area (512: about 512x512 pixels, in buckets of that area), default
    # the run's resolution:
    # a source of small images beside large ones trains at its own size (every global batch still
    # one bucket).
    resolution: int | None = None
    # Regularisation (prior-preservation) images: their loss is logged apart (loss_regularization
    # beside
    # loss_images); loss_weight weighs any source's samples in the training loss (DreamBooth's
    # prior_loss_weight).
    regularization: bool = False
    loss_weight: float = 1.0
    # A model that edits a reference image (model.reference_images): folder: the folder of the
    # reference (control)
    # images, each under its image's relative path and name (any image extension); table: the column
    # of their paths.
    control_path: str | None = None
    control_column: str | None = None


@dataclass
class VideoDataConfig:
    """`data.video`: how a video model's clips are cut from the video files (an image trains as a
    clip of one frame)."""

    # The frame counts a clip trains at, each k * 4 + 1 for Wan's VAE: for each, the windows of that
    # many frames a clip holds (a clip shorter than all is skipped, counted); every global batch
    # is of one frame count and one size.
    frames: list[int] = field(default_factory=lambda: [17])
    # head: each clip's first frames; chunk: windows that do not overlap; slide: a window every
    # `stride` frames; uniform: `windows` windows spread evenly.
    extraction: FrameExtraction = FrameExtraction.head
    stride: int = 8
    windows: int = 2
    # Read each clip at the model's frame rate (model.video.fps), frames dropped or repeated
    # by their timestamps; false: every frame as it is.
    resample: bool = True


@dataclass
class DataConfig:
    """`data` group: where images and captions come from."""

    source: DataSource = DataSource.synthetic
    path: str | None = None
    # data=folder with a model that edits a reference image (model.reference_images): the folder of
    # the reference
    # (control) images, each under its image's relative path and name, any image extension.
    control_path: str | None = None
    sources: list[SourceConfig] = field(default_factory=list)
    # The probability that a sample's caption is dropped (an empty prompt, so classifier-free
    # guidance keeps working):
    # drawn from the seed and the sample's position in the run, so a resume under any layout drops
    # the same ones.
    caption_dropout: float = 0.0
    # Tag captions ("name, red hair, smiling"): split at tag_separator, the first keep_tokens tags
    # kept in place, the
    # others shuffled (tag_shuffle) and each dropped with tag_dropout; drawn per sample like
    # caption_dropout. Captions
    # that vary are encoded each step (the latents stay cached; the frozen text encoders stay on the
    # device).
    tag_shuffle: bool = False
    keep_tokens: int = 0
    tag_dropout: float = 0.0
    tag_separator: str = ","
    # Per text encoder, the probability that its part of a sample's conditioning is zeros, as a
    # pipeline runs without
    # that encoder (SD3's without T5): data.text_encoder_dropout.t5=0.1. Drawn apart from
    # caption_dropout and from
    # each other; an encoder the model lacks is refused (its family spec's text_encoders).
    text_encoder_dropout: EncoderDropout = field(default_factory=lambda: EncoderDropout())
    # Masked loss: each image's mask (its alpha channel, else a <name>.mask.png beside it; none: the
    # whole image)
    # weighs the training loss, cached at the latents' resolution; outside the mask the loss counts
    # unmasked_weight
    # times (0: not at all). The validation loss stays unmasked.
    masked_loss: bool = False
    unmasked_weight: float = 0.0
    num_samples: int = 64
    caption_ext: str = "txt"
    center_crop: bool = True
    random_flip: bool = False
    # The share of a source's files that may be skipped as damaged (each named in the log and
    # summary.json) before the run stops: more is a copy gone wrong or the wrong folder.
    max_bad_fraction: float = 0.05
    # An image above this many pixels is skipped as too large (named in the log and summary.json);
    # the default is Pillow's own limit against decompression bombs (twice its MAX_IMAGE_PIXELS).
    max_image_pixels: int = PILLOW_PIXELS
    cache: bool = True
    cache_dir: str = "${paths.outputs}/cache"
    # Samples per file of the cache (each rank writes its share as packs of this many): a build
    # killed in the middle
    # loses at most the pack in flight; fewer, larger files suit shared filesystems.
    cache_pack: int = 256
    num_workers: int = 0
    # Aspect-ratio buckets (data=folder turns them on; see config/buckets.py). Sides default to half
    # and twice the resolution's side; every global batch comes from one bucket, and what is left
    # over in a bucket each epoch is dropped or filled up by repeating images of that bucket.
    buckets: bool = False
    bucket_min_side: int | None = None
    bucket_max_side: int | None = None
    bucket_max_aspect_ratio: float = 4.0
    bucket_step: int = 64
    bucket_remainder: Remainder = Remainder.drop
    # A video model's clips (VideoDataConfig): frame counts, how windows are cut, the frame rate.
    video: VideoDataConfig = field(default_factory=VideoDataConfig)
