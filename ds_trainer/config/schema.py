"""Typed schemas of every config group, registered in Hydra's ConfigStore.

The root schema (`ds_trainer_schema`) types every group, so a typo or a wrong type in any option file
or override fails at composition with Hydra's own message. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from ds_trainer.config import formats
from ds_trainer.config.choices import (  # noqa: F401 - the choices are read as schema.<Name> too
    LYCORIS_METHODS,
    AdapterMethod,
    Attention,
    Backend,
    Compile,
    ContextAttention,
    DataSource,
    ExportFormat,
    LoggerMode,
    LoggerName,
    LoraFormat,
    LossWeighting,
    ModelFamily,
    OffloadDevice,
    Platform,
    Precision,
    QuantizeKind,
    Remainder,
    ResumeOptimizer,
    SaveDtype,
    SchedulerName,
    SourceKind,
    TextEncoderChoice,
    TextEncoderMode,
    TimestepDensity,
    WeightUpdate,
)
from ds_trainer.config.inputs import (  # noqa: F401 - read as schema.<Name> too
    DataConfig,
    EncoderDropout,
    FlowConfig,
    ModelAbout,
    ModelConfig,
    SourceConfig,
    VideoDataConfig,
    VideoModelConfig,
)
from ds_trainer.config.tool_groups import PlanConfig, TuneConfig


@dataclass
class ZeroConfig:
    """`zero` group: the ZeRO stage (or plain DDP) and its knobs. Bucket sizes are elements."""

    backend: Backend = Backend.deepspeed
    stage: int = 2
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    reduce_bucket_size: int = 200_000_000
    allgather_bucket_size: int = 200_000_000
    round_robin_gradients: bool = False
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = True
    sub_group_size: int = 1_000_000_000
    # backend=fsdp: the module classes that become FSDP units, and the gradients' reduce dtype under 16-bit.
    fsdp_wrap: list[str] = field(default_factory=lambda: ["BasicTransformerBlock", "ResnetBlock2D"])
    fsdp_reduce_dtype: str = "fp32"


@dataclass
class OffloadConfig:
    """`offload` group: where optimizer state (stages 1-3) and parameters (stage 3) live."""

    device: OffloadDevice = OffloadDevice.none
    # None: parameters follow the stage (offloaded on stage 3 only); false keeps them on the GPU.
    params: bool | None = None
    pin_memory: bool = True
    nvme_path: str = "${paths.outputs}/nvme_swap"
    # None: chosen from the model size by the DeepSpeed config builder.
    buffer_count: int | None = None
    buffer_size: int | None = None
    # Free space required on nvme_path over the estimated swap size.
    free_space_margin: float = 1.2


@dataclass
class OptimizerConfig:
    """`optimizer` group: written as DeepSpeed's `optimizer` block (one owner: nothing else builds one).

    Fields an optimizer does not take are left out of its block (see `optimizers.PARAMS`).
    """

    name: str = "adamw"
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 1e-2
    momentum: float = 0.95
    # Prodigy only (prodigyopt's names): d_coef scales its estimated step size, slice_p > 1 estimates it from
    # every slice_p-th element (less memory), the two flags are its authors' advice for diffusion models.
    d_coef: float = 1.0
    use_bias_correction: bool = True
    safeguard_warmup: bool = True
    slice_p: int = 1


@dataclass
class SchedulerConfig:
    """`scheduler` group: DeepSpeed's LR schedulers; totals come from `train.max_steps`."""

    name: SchedulerName = SchedulerName.warmup
    # None: 10% of train.max_steps, at most 500.
    warmup_steps: int | None = None
    warmup_min_lr: float = 0.0
    warmup_type: str = "linear"
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 0.01
    # one_cycle: the LR moves between min_lr_ratio * optimizer.lr and optimizer.lr.
    min_lr_ratio: float = 0.1


@dataclass
class ResolutionConfig:
    """`resolution` group: training image size in pixels."""

    width: int = 1024
    height: int = 1024


@dataclass
class PrecisionConfig:
    """`precision` group: bf16 (fp32 masters and optimizer state), bf16_pure (bf16 masters, gradients and optimizer
    state), fp16 with dynamic loss scaling, or fp32. `weight_update` (bf16_pure only): `nearest` rounds each update
    into the bf16 weight, losing what falls below its last bit; `kahan` keeps that remainder in a bf16 compensation
    buffer and adds it back at the next step (optimi's Kahan-summed optimizers, 2 bytes a parameter more)."""

    name: Precision = Precision.bf16
    weight_update: WeightUpdate = WeightUpdate.nearest
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class LoggerConfig:
    """`logger` group: experiment tracking."""

    name: LoggerName = LoggerName.wandb
    mode: LoggerMode = LoggerMode.offline
    project: str = "ds_trainer"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    """Top-level training knobs."""

    max_steps: int = 200
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0
    seed: int = 0
    gradient_checkpointing: bool = False
    # The kernel of the trained module's attention layers (torch's scaled_dot_product_attention, which diffusers'
    # attention calls): `sdpa` lets torch pick; a named one is the only kernel allowed there, in training, samples and
    # validation (the VAE and the text encoders keep torch's pick).
    attention: Attention = Attention.sdpa
    # torch.compile (inductor) on the trained module: `blocks` each of its repeated blocks (model.compile_blocks: one
    # compiled code shared by the blocks of a shape), `full` the whole module. Compilation's time is reported apart
    # from s/it (summary.json: compile_s); a new shape (a bucket, a sample's batch) compiles again once.
    compile: Compile = Compile.none
    # 0: save only at the end.
    checkpoint_every: int = 0
    # Also save when this much wall time has passed since the last checkpoint (0: never by time), so that what no
    # signal handler can save (kill -9, a lost node, a power cut) loses at most that much training.
    checkpoint_every_minutes: float = 30.0
    checkpoints_to_keep: int = 2
    # Every checkpoint also holds a portable state (fp32 weights and Adam moments by parameter name, about
    # 12 bytes per trainable parameter: as much again as DeepSpeed's own optimizer files), so that it can
    # resume under another zero/offload/ranks/batch split. false leaves it out: such a checkpoint resumes
    # only under the layout it was saved with (or after `python -m ds_trainer.convert --import-to`).
    portable_state: bool = True
    # At the end: save a checkpoint, export the UNet (sweeps that only measure turn both off).
    final_checkpoint: bool = True
    export: bool = True
    ema: bool = False
    ema_decay: float = 0.9999
    ema_device: str = "cpu"
    log_every: int = 1
    min_snr_gamma: float | None = None
    noise_offset: float = 0.0


@dataclass
class AdapterConfig:
    """`adapter` group: what is trained. `none` trains the whole UNet; `lora` trains LoRA matrices on the
    modules whose names end with one of `targets` (peft's matching) and freezes the rest; `dora`, `lokr`, `loha`
    train peft's DoRA, LoKr and LoHa on the same modules (docs/lora.md)."""

    method: AdapterMethod = AdapterMethod.none
    rank: int = 16
    alpha: int = 16
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    # LoKr: the Kronecker factor's size (the smaller matrix is at most factor x factor; -1: as square as the
    # layer's dimensions allow), as LyCORIS' `factor`.
    factor: int = -1
    # A diffusers-format LoRA file (or its folder) to continue from; its rank and targets must match.
    init_from: str | None = None
    # dtype of the exported LoRA files in `<run>/lora/` (cast from the fp32 masters).
    save_dtype: SaveDtype = SaveDtype.fp32
    # The LoRA files written, each a layout (config/formats.py): diffusers' (`pytorch_lora_weights.safetensors`,
    # `load_lora_weights`), kohya's (`kohya.safetensors`: lora_unet_*/lora_te1_*/lora_te2_* names, which ComfyUI,
    # Forge and kohya's scripts load); docs/exports.md.
    formats: list[LoraFormat] = field(  # type: ignore[valid-type]
        default_factory=lambda: [LoraFormat[name] for name in formats.LORA])


@dataclass
class ExportConfig:
    """`export`: what a full fine-tune's end writes (`train.export=false` writes nothing). `diffusers`: the trained
    model's folder (`<run>/unet`, `<run>/transformer`, with EMA `..._ema`); `single_file`: one `.safetensors` in the
    makers' layout (`<run>/single_file/model.safetensors`, with EMA `model_ema.safetensors`: SDXL with its VAE and
    both text encoders in Stability's layout, SD3/SD3.5's MMDiT in Stability's, Flux's transformer in Black Forest
    Labs'), which ComfyUI, Forge and InvokeAI load; both (docs/exports.md)."""

    # The model files written (config/formats.py): diffusers' folders, the makers' single file.
    formats: list[ExportFormat] = field(  # type: ignore[valid-type]
        default_factory=lambda: [ExportFormat[name] for name in formats.MODEL])
    # dtype of the single file (the diffusers folders stay float32, from the fp32 masters).
    dtype: SaveDtype = SaveDtype.bf16
    # `<run>/README.md`: a model card (base model and license, what trained, data, resolution, validation loss,
    # samples) beside the exports.
    card: bool = True


@dataclass
class TextEncodersConfig:
    """`text_encoders` group: whether SDXL's text encoders train with the UNet
    (ds_trainer/train/families/text_encoders.py).
    `frozen` caches their embeddings; `lora` trains LoRA matrices on the modules of the chosen encoders whose names
    end with one of `targets`; `full` trains their weights. Trained encoders go into the one model DeepSpeed (or
    DDP) wraps, in a parameter group of their own at `lr`."""

    mode: TextEncoderMode = TextEncoderMode.frozen
    which: TextEncoderChoice = TextEncoderChoice.both
    # Peak learning rate of the encoders' parameter group, on the UNet's schedule; None: optimizer.lr.
    lr: float | None = None
    # Steps the encoders' LR warms up over, in the schedule's family (scheduler.name); None: scheduler.warmup_steps.
    warmup_steps: int | None = None
    rank: int = 8
    alpha: int = 8
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj"])


@dataclass
class QuantizeConfig:
    """`quantize` group: the frozen base of a LoRA run held quantized, with bitsandbytes: `int8`
    (LLM.int8: int8 weights with a scale per row, activation outliers above `threshold` in 16-bit) or `nf4` (4-bit
    NormalFloat in blocks of 64, the QLoRA format, with the blocks' scales quantized again); or with torchao: `fp8`
    (float8 e4m3 weights with an fp32 scale per row, weight-only). Every `nn.Linear` of the
    UNet or transformer is replaced before the adapters are added (convolutions, norms and embeddings stay 16-bit);
    the LoRA file is written against the unquantized base. Samples and validation run on the quantized model."""

    kind: QuantizeKind = QuantizeKind.none
    # The frozen text encoders too (what encodes the cache, the sample prompts, and captions whose tags vary).
    text_encoders: bool = True
    # int8 only: activation values above this stay in 16-bit (bitsandbytes' LLM.int8 default 6.0; 0: none).
    threshold: float = 6.0


def trains_text_encoders(cfg: Any) -> bool:
    """Whether the text encoders train (`text_encoders=lora|full`): False when they are frozen or the group is
    absent (configs written before it existed). Takes a composed config or a plain dict of one (a config.yaml)."""
    te = cfg.get("text_encoders")
    mode = te.get("mode", "frozen") if te is not None else "frozen"
    return str(getattr(mode, "value", mode)) != "frozen"


@dataclass
class SamplesConfig:
    """`samples` group: images generated during training (ds_trainer/train/observe/sampling.py)."""

    enabled: bool = False
    # A list of prompts, or the path of a file with one prompt a line (so the type is checked by config/checks).
    prompts: Any = field(default_factory=list)
    # Every N optimizer steps (0: only at the end), and at the last step when at_end.
    every: int = 0
    at_end: bool = True
    steps: int = 25
    guidance_scale: float = 5.0
    negative_prompt: str = ""
    # A model that edits a reference image (model.reference_images: Flux.1 Kontext): the reference of each prompt, one
    # image path per prompt, or one for all of them.
    images: list[str] = field(default_factory=list)
    # One image per prompt and seed.
    seeds: list[int] = field(default_factory=lambda: [0])
    # None: the training resolution.
    width: int | None = None
    height: int | None = None
    # A video model's clips: their frames (None: the most of data.video.frames).
    frames: int | None = None
    # With train.ema=true: sample with the EMA weights (the exported pipeline's UNet) rather than the trained ones.
    ema: bool = True


@dataclass
class ValidationConfig:
    """`validation` group: a validation loss comparable across layouts (config/holdout.py,
    train/observe/validate.py)."""

    enabled: bool = False
    # Every N optimizer steps (0: only at the end); always at the last step, and before the first when at_start.
    every: int = 0
    at_start: bool = False
    # Held out of data.path by a fixed rule (the same images whatever the ranks): a fraction (< 1) or a count
    # (>= 1). Synthetic data: that many extra images, never trained. Ignored when `path` names a folder.
    split: float = 0.05
    path: str | None = None
    # Evenly spaced diffusion timesteps each image is scored at.
    timesteps: int = 4
    # (image, timestep) pairs per forward; 0: train.micro_batch_size.
    batch_size: int = 0
    # Seeds the noise of every (image, timestep) pair; not train.seed, so runs of different seeds compare.
    seed: int = 0
    # With train.ema=true (a full fine-tune): also val_loss_ema, from the EMA weights.
    ema: bool = True


@dataclass
class PathsConfig:
    outputs: str = "outputs"


@dataclass
class ResolvedConfig:
    """What the config checks decided (config/checks/resolve.py), in `config.yaml`: what ran."""

    platform: str | None = None
    backend: str | None = None
    world_size: int | None = None
    optimizer: str | None = None
    optimizer_state_on: str | None = None
    params_on: str | None = None
    nvme_swap_bytes: int | None = None
    # DeepSpeed's optimizer is torch's AdamW (`torch_adam`): FusedAdam cannot be compiled on this machine.
    torch_adam: bool = False
    # optimi's Kahan optimizer steps in its torch loop: a partition past its Triton kernel's reach.
    kahan_loop: bool = False
    # Parameters the optimizer trains (the UNet's, or the adapters' with adapter=lora); set before training.
    trainable_params: int | None = None
    # What the precision means under the backend that runs (checks.resolve.precision_meaning).
    precision: dict[str, Any] | None = None
    # backend=fsdp: what the precision and sharding mean under FSDP2 (the plugin's fields as the run set them).
    fsdp: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class ParallelConfig:
    """`parallel`: how the ranks divide the work beyond data parallelism (docs/backends.md)."""

    # Context parallelism: each sample's sequence split over this many ranks (a divisor of the
    # world size; the ranks form a data x context mesh, the data's streams one per context group).
    context: int = 1
    # How attention runs on a split sequence: ulysses (all-to-all over heads) or ring.
    attention: ContextAttention = ContextAttention.ulysses


@dataclass
class Config:
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    resolution: ResolutionConfig = field(default_factory=ResolutionConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    text_encoders: TextEncodersConfig = field(default_factory=TextEncodersConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    resolved: ResolvedConfig = field(default_factory=ResolvedConfig)
    # Processes of the run; None: from the launcher (WORLD_SIZE), else 1.
    world_size: int | None = None
    platform: Platform = Platform.auto
    dry_run: bool = False
    # Build the latent cache (and the validation set's) and stop: `python -m ds_trainer.cache <overrides>`, under any
    # launcher, so that training later starts from a complete cache. Resumable: what is encoded stays.
    cache_only: bool = False
    # None, "latest", or a checkpoint folder.
    resume: str | None = None
    # What a resume under another optimizer type or architecture carries: `reset` takes the weights only.
    resume_optimizer: ResumeOptimizer = ResumeOptimizer.keep
    # A checkpoint this user's runs did not write (config/trust.py) resumes through its portable
    # state (safetensors and JSON): its DeepSpeed and Accelerate files are pickles. true loads
    # them natively all the same.
    resume_trust_native: bool = False


def register() -> None:
    """Register the root schema; `conf/config.yaml` names it first in its defaults."""
    ConfigStore.instance().store(name="ds_trainer_schema", node=Config)
