"""The fixed choices of the config groups (string Enums, as OmegaConf types them), torch-free:
config/schema.py types the groups with them and re-exports them. The families', formats' and source
kinds' values are their registries' (config/families/, config/formats.py, config/source_kinds.py).
"""

from __future__ import annotations

from enum import Enum

from ds_trainer.config import families, formats


class Backend(str, Enum):
    ddp = "ddp"
    deepspeed = "deepspeed"
    fsdp = "fsdp"  # PyTorch FSDP2 through Accelerate; `stage` 3 reshards after forward, 2 does not


class ResumeOptimizer(str, Enum):
    keep = "keep"  # the optimizer state carries over (refused when it cannot)
    reset = "reset"  # weights only: the optimizer starts fresh (recorded as a warning)


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class SchedulerName(str, Enum):
    warmup = "warmup"
    warmup_decay = "warmup_decay"
    warmup_cosine = "warmup_cosine"
    one_cycle = "one_cycle"
    constant = "constant"


class Precision(str, Enum):
    bf16 = "bf16"
    bf16_pure = "bf16_pure"
    fp16 = "fp16"
    fp32 = "fp32"


class Attention(str, Enum):
    # torch's scaled_dot_product_attention picks the kernel (the fastest that takes the inputs)
    sdpa = "sdpa"
    flash = "flash"  # FlashAttention-2 (CUDA sm80+ in fp16/bf16; torch's own CPU kernel)
    efficient = "efficient"  # memory-efficient attention (xFormers' kernel; CUDA)
    cudnn = "cudnn"  # cuDNN's fused attention (CUDA sm80+ with cuDNN 9)
    math = "math"  # the unfused reference: every device, most memory


class Compile(str, Enum):
    none = "none"  # eager
    # torch.compile each repeated block of the trained module (model.compile_blocks)
    blocks = "blocks"
    # torch.compile the whole trained module (one graph where it traces; longer to compile)
    full = "full"


class WeightUpdate(str, Enum):
    # the update is added and rounded to the weight's dtype (what DeepSpeed and FSDP do)
    nearest = "nearest"
    # bf16 weights keep a bf16 compensation of what rounding lost (optimi's Kahan summation)
    kahan = "kahan"


class DataSource(str, Enum):
    synthetic = "synthetic"
    folder = "folder"
    sources = "sources"  # data.sources: several folders, tables, tar shards, saved datasets


class SourceKind(str, Enum):
    # from the path: a saved dataset's folder is hf, another folder folder, .jsonl/.csv/.parquet
    # table
    auto = "auto"
    folder = "folder"  # images with same-name caption files (or a metadata.jsonl)
    table = "table"  # a .jsonl, .csv or .parquet file of image paths (or image bytes) and captions
    # tar shards (a path or a brace pattern), a sample's members sharing a key
    webdataset = "webdataset"
    hf = "hf"  # a Hugging Face dataset saved with save_to_disk


class Remainder(str, Enum):
    drop = "drop"
    repeat = "repeat"


class LoggerName(str, Enum):
    wandb = "wandb"
    none = "none"


class LoggerMode(str, Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class AdapterMethod(str, Enum):
    none = "none"
    lora = "lora"
    dora = "dora"  # LoRA with a trained magnitude per output row (peft's use_dora)
    lokr = "lokr"  # LyCORIS' Kronecker product (peft's LoKr)
    loha = "loha"  # LyCORIS' Hadamard product of two low-rank pairs (peft's LoHa)


# The methods whose file is LyCORIS' layout (lycoris.kohya's module names), not a LoRA's: what
# writes, loads and
# describes them differs (config/checks/adapter.py, train/layouts/metadata.py, export/card.py,
# tools/convert.py).
LYCORIS_METHODS = frozenset({AdapterMethod.lokr.value, AdapterMethod.loha.value})


class QuantizeKind(str, Enum):
    none = "none"
    int8 = "int8"
    nf4 = "nf4"
    fp8 = "fp8"


class TextEncoderMode(str, Enum):
    frozen = "frozen"
    lora = "lora"
    full = "full"


class TextEncoderChoice(str, Enum):
    both = "both"
    clip_l = "clip_l"  # SDXL's text_encoder: CLIP ViT-L/14
    bigg = "bigg"  # SDXL's text_encoder_2: OpenCLIP ViT-bigG/14


class SaveDtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


# export.formats and adapter.formats: one value per record of config/formats.py.
ExportFormat = Enum(  # type: ignore[misc]
    "ExportFormat", {name: name for name in formats.MODEL}, type=str
)
LoraFormat = Enum(  # type: ignore[misc]
    "LoraFormat", {name: name for name in formats.LORA}, type=str
)


# model.family: one value per family of the registry (config/families/: each family's facts in its
# spec).
ModelFamily = Enum(  # type: ignore[misc]
    "ModelFamily", {name: name for name in families.NAMES}, type=str
)


class VideoCondition(str, Enum):
    """What a video model is given beside the caption (model.video.condition)."""

    none = "none"  # text to video
    # Wan 2.1 I2V: the first frame's CLIP image tokens, a mask and the VAE's latents of the first
    # frame followed by empty frames, as input channels beside the noisy latents
    clip_and_latents = "clip_and_latents"
    latents = "latents"  # Wan 2.2 I2V A14B: the mask and the first frame's latents, no CLIP
    # Wan 2.2 TI2V: the first latent frame is the clean first frame's, its tokens at timestep 0
    first_frame = "first_frame"


class Expert(str, Enum):
    """Which expert of a two-expert model (Wan 2.2 A14B) trains (model.video.expert)."""

    # the high-noise expert (the pipeline's transformer): timesteps at or above the boundary
    high = "high"
    low = "low"  # the low-noise expert (the pipeline's transformer_2): timesteps below it
    # each on its own timesteps, one after the other in one command (the high-noise expert's phase,
    # then the low-noise one's beside it): the family's spec says the phases (config/phases.py)
    both = "both"


class FrameExtraction(str, Enum):
    """How a video clip's training windows are cut (data.video.extraction), for each frame count."""

    head = "head"  # the first frames
    chunk = "chunk"  # consecutive windows that do not overlap
    slide = "slide"  # a window every data.video.stride frames
    uniform = "uniform"  # data.video.windows windows spread evenly over the clip


class ContextAttention(str, Enum):
    """How attention sees a sequence split across the context ranks (parallel.attention)."""

    # DeepSpeed-Ulysses: an all-to-all before and after attention trades the split of the
    # sequence for a split of the heads (each rank attends over the whole sequence, for its heads)
    ulysses = "ulysses"
    # each rank keeps its keys and values and passes them around the ring (needs a CUDA kernel that
    # returns the log-sum-exp)
    ring = "ring"


class TimestepDensity(str, Enum):
    logit_normal = "logit_normal"
    mode = "mode"
    uniform = "uniform"


class LossWeighting(str, Enum):
    none = "none"
    sigma_sqrt = "sigma_sqrt"
    cosmap = "cosmap"


class Platform(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"
    mps = "mps"
    rocm = "rocm"
