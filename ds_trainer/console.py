"""The terminal shows ds_trainer; what the libraries it drives say goes to the run's log file.

Measured before: under ZeRO-3 every step printed torch's two-line FutureWarning (DeepSpeed calls torch's old
collective names), breaking the progress bar into a wall of warnings; every run printed DeepSpeed's
"Setting accelerator to CPU", its "get learning rate from scheduler before it has started", diffusers'
"modules in AutoencoderKL that should be kept in float32: []" and transformers' torchvision notes; and the
save printed Accelerate's INFO lines about DeepSpeed's files.

Two rules, nothing blanket:
- `KNOWN`: messages of the libraries that were read and found harmless, each matched by the logger that
  emits it and a pattern of its text, with the reason written beside it. They go to the run's log file once
  (the first time; a per-step warning is one line there), never to the terminal. A message of the same
  library that is not in the list still reaches the terminal.
- `ConsoleFilter` (on the console handler, conf/config.yaml): another library's INFO lines (Accelerate's
  "Saving current state to ...") stay in the log file; their warnings and errors still reach the terminal.

ds_trainer's own warnings (fallbacks, substitutions, refusals) are never filtered. `install()` runs once per
process, before the libraries are imported: each filter sits on the logger that creates the message, which
logging keeps whatever the library later does to its handlers.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

OURS = "ds_trainer"


@dataclass(frozen=True)
class Known:
    logger: str  # the logger that creates the record ("py.warnings": warnings.warn, through captureWarnings)
    pattern: str  # searched in the message
    why: str  # why it is harmless: the record of the review


KNOWN = (
    Known("py.warnings", r"torch/distributed/c10d_logger\.py:\d+: FutureWarning: `torch\.distributed\."
          r"(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
          "DeepSpeed's ZeRO-3 calls torch's collectives by their old names, every step; the new names do the same "
          "(torch 2.13, DeepSpeed 0.19.8); nothing for a user to change"),
    Known("py.warnings", r"hydra/_internal/config_loader_impl\.py:\d+: UserWarning: provider=hydra\.searchpath in "
          r"main, path=\S+/presets is not available\.",
          "conf/config.yaml puts <paths.outputs>/presets (where the tune writes its preset) on Hydra's search "
          "path; until a preset is written there the folder does not exist, which is normal"),
    Known("py.warnings", r"accelerate/state\.py:\d+: UserWarning: OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at "
          r"\d+ to improve oob performance\.",
          "Accelerate gives each CPU rank (zero=ddp and FSDP on the CPU) the machine's physical cores divided by the "
          "ranks on it, and says so; that is the right share, and OMP_NUM_THREADS set by the user overrides it"),
    Known("DeepSpeed", r"^Setting accelerator to CPU\. If you have GPU",
          "DeepSpeed found no GPU; the run's own start-up lines say which device it trains on, and "
          "`python -m ds_trainer.doctor` why no GPU is seen"),
    Known("DeepSpeed", r"^Attempting to get learning rate from scheduler before it has started$",
          "Accelerate reads the learning rate of DeepSpeed's WarmupLR before the first step; the first step "
          "sets it and every logged step has it (metrics.jsonl `lr`)"),
    Known("diffusers.models.modeling_utils", r"^There are modules in \w+ that should be kept in float32: \[\]\.",
          "diffusers warns on every `.to(dtype)` of a model, also when its list of float32 modules is empty, as "
          "here: nothing is cast that should not be (a non-empty list still reaches the terminal)"),
    Known("DeepSpeed", r"^\*+ You are using ZeRO with an untested optimizer, proceed with caution \*+$",
          "optimizer=adamw_torch, adamw8bit, prodigy and schedule_free_adamw are handed to DeepSpeed as client "
          "optimizers on purpose; the run logs "
          "the class that steps (`optimizer ... steps`) and refuses to start if it is another"),
    Known("bitsandbytes.backends.cpu.ops", r"^Failed to load CPU gemm_4bit_forward from kernels-community",
          "bitsandbytes looks for an optional 4-bit matmul kernel package when it loads; optimizer=adamw8bit uses "
          "its 8-bit optimizer kernels, which it has"),
    Known("torchao", r"^Failed to load \S+/torchao/_C_(mxfp8|cutlass_90a)\S*\.so: ",
          "torchao's MX-format and CUTLASS sm90a kernels are CUDA builds for other torch versions; quantize=fp8's "
          "weight-only float8 dequantizes in torch and never calls them (its layers are checked when quantized)"),
    Known("torchao.kernel.intmm", r"^Warning: Detected no triton, on systems without Triton certain kernels will not "
          r"work$", "torchao's int8 matmul kernels need Triton (CUDA); quantize=fp8's weight-only float8 does not use "
          "them"),
    Known("torch.utils._pytree", r"^<enum '(KernelPreference|ScaleCalculationMode)'> is an Enum subclass and is now "
          r"natively supported by torch\.compile", "torchao 0.18 registers two of its enums with torch's pytree as "
          "older torch versions needed; torch 2.13 says it no longer must (a deprecation for torchao)"),
    Known("diffusers.quantizers.torchao.torchao_quantizer", r"^Unable to import `torchao` Tensor objects\. This may "
          r"affect loading checkpoints serialized with `torchao`$",
          "diffusers' torchao loader names tensor classes torchao 0.18 moved; it matters for loading a checkpoint "
          "saved as torchao tensors, which ds_trainer never does (quantize=fp8 quantizes the loaded weights)"),
    Known("py.warnings", r"peft/tuners/lora/torchao\.py:\d+: UserWarning: TorchaoLoraLinear was instantiated without "
          r"`get_apply_tensor_subclass`", "peft cannot merge a LoRA into a torchao weight without it; ds_trainer never "
          "merges: the LoRA files are written from the adapters, against the unquantized base"),
    Known("py.warnings",
          r"diffusers/models/embeddings\.py:\d+: FutureWarning: `FluxPosEmbed` is deprecated",
          "diffusers' ChromaTransformer2DModel builds its RoPE table with the class's old import "
          "path (diffusers 0.42); the class is the same, nothing for a user to change"),
    Known("transformers.utils.import_utils", r"^`\w+ImageProcessor` requires torchvision \(not installed\); "
          r"falling back to `\w+ImageProcessorPil`",
          "the pipeline's image processors (for a safety checker SDXL does not have) fall back to PIL; training, "
          "sampling and export never run them"),
)
_PATTERNS: dict[str, list[re.Pattern[str]]] = collections.defaultdict(list)
for _known in KNOWN:
    _PATTERNS[_known.logger].append(re.compile(_known.pattern))


def known(record: logging.LogRecord) -> bool:
    """Whether `record` is one of `KNOWN`."""
    patterns = _PATTERNS.get(record.name)
    if not patterns:
        return False
    message = record.getMessage()
    return any(p.search(message) for p in patterns)


class _ToLogFile(logging.Filter):
    """On a logger that creates known messages: those go to the run's log file (once each) instead of on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.early: collections.deque[logging.LogRecord] = collections.deque(maxlen=50)

    def filter(self, record: logging.LogRecord) -> bool:
        if not known(record):
            return True
        message = record.getMessage()
        if message not in self.seen:
            self.seen.add(message)
            self.early.append(record)
            _flush(self.early)
        return False


def _flush(records: collections.deque[logging.LogRecord]) -> None:
    """Write `records` to the log files of the root logger; keep them while it has none (before Hydra set up
    logging: the records of imports), to write them with the next ones."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return
    while records:
        record = records.popleft()
        for handler in files:
            if record.levelno >= handler.level:
                handler.handle(record)


_FILTER = _ToLogFile()


class ConsoleFilter(logging.Filter):
    """For the terminal's handler: ds_trainer's records at any level, another library's from WARNING on."""

    def filter(self, record: logging.LogRecord) -> bool:
        _flush(_FILTER.early)  # records kept from before the log file existed join it now
        ours = record.name == OURS or record.name.startswith(OURS + ".")
        return ours or record.levelno >= logging.WARNING


def install() -> None:
    """Put the known messages' filter on the loggers that create them, and send `warnings.warn` through logging
    (so a warning reaches the run's log file too, and the terminal through the console filter). Idempotent."""
    # Off, then on: a `warnings.catch_warnings` block that ended since the last call put back the hook it found,
    # and captureWarnings(True) alone would then do nothing (it remembers having been called).
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    for name in _PATTERNS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


# Libraries that print through a handler of their own (DeepSpeed to stdout, transformers and diffusers to stderr),
# never to the run's log file; the root logger of a run has both the terminal (filtered) and the file.
LIBRARY_LOGGERS = {"DeepSpeed": "deepspeed", "transformers": "transformers", "diffusers": "diffusers"}


def adopt() -> None:
    """Route the messages of the libraries imported so far through the root logger: each keeps its level, its
    unknown warnings reach the terminal (stderr: stdout carries the dry run's JSON) and the log file. A library
    sets its handler up when it is imported, so this runs after the imports (Accelerate's set-up, the frozen
    models' load); idempotent."""
    for name, module in LIBRARY_LOGGERS.items():
        if module not in sys.modules:
            continue
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # the library's own console handler, not a user's file
                logger.removeHandler(handler)
        logger.propagate = True


def for_tool(level: int = logging.INFO) -> None:
    """The logging of a command without a run directory (convert, ops): lines on stderr as messages alone,
    through the console filter; the known messages, with no log file to go to, are dropped."""
    install()
    logging.basicConfig(level=level, format="%(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ConsoleFilter) for f in handler.filters):
            handler.addFilter(ConsoleFilter())


def flush() -> None:
    """Write the known messages kept from before the run's log file existed (called once it does)."""
    _flush(_FILTER.early)


@contextlib.contextmanager
def also_to(path: Path, main: bool = True) -> Iterator[None]:
    """Inside, the run's log lines also go to `path` (a phase of a run: its own folder's log file),
    as the run's log file takes them; on the main process only (`main`)."""
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    if not main or not files:
        yield
        return
    handler = logging.FileHandler(path)
    handler.setLevel(files[0].level)
    handler.setFormatter(files[0].formatter)
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


@contextlib.contextmanager
def stdout_to_log(what: str) -> Iterator[None]:
    """Lines a library `print`s to stdout while `what` runs (DeepSpeed's "deepspeed_shm_comm_op built
    successfully" when its CPU communication op loads) go to the log file at INFO, not to the terminal:
    stdout carries the dry run's JSON."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        lines = [line for line in buffer.getvalue().splitlines() if line.strip()]
        for line in lines:
            logging.getLogger("deps.stdout").info("%s (stdout during %s)", line, what)
        sys.stdout.flush()
