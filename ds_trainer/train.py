"""The SDXL training recipe, top to bottom: setup, loop, save.

Only the UNet goes through `accelerator.prepare`, with the optimizer and scheduler the DeepSpeed JSON
defines (DummyOptim/DummyScheduler stand in for them); the VAE and text encoders stay frozen and out
of ZeRO. Noise and timesteps come from a generator seeded by (seed, micro-batch, rank) and the data
order is a function of the step, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer import accel, checkpoint, data, ds_config, hardware, metrics, models, nvme
from ds_trainer.ema import EMA
from ds_trainer.errors import TrainingError

log = logging.getLogger("ds_trainer")


class Interrupted(Exception):
    """A signal stopped the run after a step; its checkpoint is saved."""

    def __init__(self, step: int, path: Path | None, stop: _StopRequest) -> None:
        where = f"checkpoint {path}" if path else "no checkpoint (it stopped before the first step)"
        super().__init__(f"stopped by {stop.name} after step {step}; {where}. resume=latest continues from it")
        self.stop = stop


class _StopRequest:
    """SIGTERM (scancel, a scheduler's preemption, `kill`, `docker stop`) or SIGUSR2 (what submitit has
    Slurm send before a time limit) asks the run to stop at the end of the current step with a
    checkpoint, instead of dying mid-step: nothing is lost. The ranks agree on the step through the loss
    all-reduce, so a signal that reaches one rank stops them all together. Whoever handled the signal
    before the run (submitit: requeue the job on SIGUSR2) gets it once the checkpoint is saved."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    def __enter__(self) -> _StopRequest:
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            log.warning("%s: stopping after this step with a checkpoint", signal.Signals(signum).name)
            self.signum = signum

    def forward(self) -> None:
        """Call the handler the signal had before the run, if it was a Python function."""
        handler = self._previous.get(self.signum) if self.signum else None
        if callable(handler):
            handler(self.signum, None)


def _single_process_env() -> None:
    """`python -m ds_trainer` without a launcher: a one-rank group, like torchrun would set up."""
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _optimizer_and_scheduler(cfg: DictConfig, ds: dict[str, Any] | None, params: Any) -> tuple[Any, Any]:
    """DeepSpeed builds both from its JSON (placeholders here); DDP gets torch.optim and DeepSpeed's
    LR schedule classes from the same blocks, so one config owns both backends."""
    from accelerate.utils import DummyOptim, DummyScheduler

    if ds is not None:
        optimizer = DummyOptim(params, lr=ds["optimizer"]["params"]["lr"])
        scheduler = DummyScheduler(optimizer) if "scheduler" in ds else None
        return optimizer, scheduler
    from deepspeed.runtime import lr_schedules

    block = ds_config.optimizer_block(cfg)
    torch_class = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "Adagrad": torch.optim.Adagrad}
    optimizer = torch_class[block["type"]](params, **block["params"])
    schedule = ds_config.scheduler_block(cfg)
    scheduler = getattr(lr_schedules, schedule["type"])(optimizer, **schedule["params"]) if schedule else None
    return optimizer, scheduler


def _loss(cfg: DictConfig, unet: Any, noise_sched: Any, batch: dict[str, torch.Tensor], gen: torch.Generator,
          device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    latents = batch["latents"]
    noise = torch.randn(latents.shape, generator=gen)
    if cfg.train.noise_offset:
        noise += cfg.train.noise_offset * torch.randn((*latents.shape[:2], 1, 1), generator=gen)
    t = torch.randint(0, noise_sched.config.num_train_timesteps, (latents.shape[0],), generator=gen)
    noisy = noise_sched.add_noise(latents, noise, t)
    prediction_type = noise_sched.config.prediction_type
    target = noise if prediction_type == "epsilon" else noise_sched.get_velocity(latents, noise, t)
    cond = {"text_embeds": batch["pooled"].to(device, dtype), "time_ids": batch["time_ids"].to(device, dtype)}
    pred = unet(noisy.to(device, dtype), t.to(device), batch["prompt_embeds"].to(device, dtype),
                added_cond_kwargs=cond).sample
    per_sample = torch.nn.functional.mse_loss(pred.float(), target.to(device).float(), reduction="none")
    per_sample = per_sample.mean(dim=list(range(1, per_sample.ndim)))
    if cfg.train.min_snr_gamma:
        from diffusers.training_utils import compute_snr

        snr = compute_snr(noise_sched, t).to(device)
        clipped = snr.clamp(max=float(cfg.train.min_snr_gamma))
        per_sample = per_sample * (clipped / snr if prediction_type == "epsilon" else clipped / (snr + 1))
    return per_sample.mean()


def _grad_norm(unet: Any, accelerator: Any, ds: dict[str, Any] | None, clip: float) -> float | None:
    if ds is not None:
        engine = accelerator.deepspeed_engine_wrapped.engine
        norm = engine.get_global_grad_norm()
        return float(norm) if norm is not None else None
    if accelerator.sync_gradients:
        norm = accelerator.clip_grad_norm_(unet.parameters(), clip if clip > 0 else float("inf"))
        return float(norm)
    return None


def _export(cfg: DictConfig, accelerator: Any, unet: Any, ema: EMA | None, frozen: Any, run_dir: Path) -> None:
    """The UNet (and EMA UNet) in diffusers format; for sdxl_tiny a whole SDXL pipeline folder.

    `get_state_dict` is collective: under ZeRO-3 every rank takes part in gathering the 16-bit weights.
    """
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

    state = accelerator.get_state_dict(unet)
    if not accelerator.is_main_process:
        return
    config = accelerator.unwrap_model(unet).config
    exported = {}
    for name, weights in (("unet", state), ("unet_ema", ema.shadow if ema else None)):
        if weights is None:
            continue
        model = UNet2DConditionModel.from_config(config)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        model.save_pretrained(run_dir / name)
        exported[name] = model
    if cfg.model.name == "sdxl_tiny":
        for part in (frozen.vae, frozen.text_encoder, frozen.text_encoder_2):
            part.to("cpu", torch.float32)
        pipe = StableDiffusionXLPipeline(vae=frozen.vae, text_encoder=frozen.text_encoder,
                                         text_encoder_2=frozen.text_encoder_2, tokenizer=frozen.tokenizer,
                                         tokenizer_2=frozen.tokenizer_2,
                                         unet=exported.get("unet_ema", exported["unet"]),
                                         scheduler=models.inference_scheduler(cfg))
        pipe.save_pretrained(run_dir / "pipeline")  # type: ignore[attr-defined]


def _prepare_nvme(cfg: DictConfig, accelerator: Any) -> None:
    """Before DeepSpeed starts: the async_io op must load, and stale swap from earlier runs must go."""
    if "nvme" not in (cfg.resolved.optimizer_state_on, cfg.resolved.params_on):
        return
    if accelerator.local_process_index == 0:
        error = nvme.aio_load_error()
        if error:
            raise TrainingError(f"offload=nvme: {error}")
        for stale in nvme.remove_stale_swap(cfg.offload.nvme_path):
            log.warning("removed stale NVMe swap folder %s (left by an earlier run; it breaks resumes)", stale)
    accelerator.wait_for_everyone()


def _check_swap_space(cfg: DictConfig, accelerator: Any) -> None:
    """Right before DeepSpeed writes its NVMe swap, check the room again: the disk may have filled up since
    the configuration was checked, and DeepSpeed does not notice a full swap disk (the files end short
    and it aborts the process on reading one back: no message, no summary)."""
    from ds_trainer import validation

    why = validation.swap_problem(cfg) if accelerator.local_process_index == 0 else None
    if accel.any_rank(accelerator, why is not None):
        raise TrainingError(f"offload.nvme_path={cfg.offload.nvme_path} {why or 'is full on another node'}: the disk "
                            "filled up after the configuration was checked; nothing was trained and no checkpoint "
                            "was touched. Free space there or set offload.nvme_path to a larger disk, then run "
                            "again (resume=latest continues)")


def _build_cache(cfg: DictConfig, accelerator: Any, dataset: Any, frozen: Any) -> data.LatentCache | None:
    """Every rank encodes its share of what is missing; rank 0 then marks the cache complete.

    No rank branches on whether the cache looks complete: another run may finish it between two
    ranks' looks (a sweep's cells run at once), and ranks that disagree would wait on different
    barriers forever. Encoding what is already there is a no-op.
    """
    if not cfg.data.cache:
        return None
    cache = data.LatentCache(cfg, dataset)
    start = time.time()
    cache.build(dataset, frozen, accelerator.process_index, accelerator.num_processes, accelerator.device)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and not cache.complete:
        cache.finish()
        log.info("cached latents and embeddings of %d samples in %.1fs: %s", len(dataset), time.time() - start,
                 cache.dir)
    accelerator.wait_for_everyone()
    return cache


def _log_memory_plan(cfg: DictConfig, info: Any, world: int) -> None:
    """Log the planner's estimate for this run; warn when it exceeds the GPU."""
    from ds_trainer import plan

    zero = ds_config.zero_option(cfg)
    # The effective offload: below stage 3 an NVMe request runs as cpu.
    offload = "none" if cfg.resolved.optimizer_state_on == "gpu" else (
        cfg.offload.device.value if zero == "stage3" else "cpu")
    try:
        estimate = plan.estimate(cfg, zero, offload, world)
    except Exception as exc:  # noqa: BLE001 - a plan is advice; training goes on without it
        log.warning("no memory plan for this model (%s)", exc)
        return
    log.info("memory plan (python -m ds_trainer.plan): %s", plan.describe(estimate))
    total = (info.gpu_memory_mib or 0) * 2**20
    if info.kind == "cuda" and total and estimate.gpu > total:
        log.warning("the memory plan (%.1f GiB per rank) exceeds this GPU's %.1f GiB: expect out of memory; "
                    "`python -m ds_trainer.plan` with the same overrides shows what fits",
                    estimate.gpu / 2**30, total / 2**30)


def run(cfg: DictConfig, ds: dict[str, Any] | None, run_dir: Path, name: str = "default") -> dict[str, Any]:
    """Train as `cfg` says; returns the summary, also written to `summary.json` whatever happens:
    `ok`, `oom` (with what to try next) or `error` (with its message)."""
    _single_process_env()
    info = hardware.confirm_with_torch(hardware.detect(cfg.resolved.platform))
    accelerator = accel.make_accelerator(cfg, ds, info.kind, run_dir)
    # Rank 0 decides what to resume from and tells the others: ranks looking at the file system at
    # different moments could otherwise disagree and then load different checkpoints.
    resume_from = accel.from_main(accelerator, checkpoint.find_resume(cfg, run_dir) if accelerator.is_main_process
                                  else None)
    wandb_id = (checkpoint.complete(resume_from) or {}).get("wandb_id") if resume_from else None
    tracker = metrics.Tracker(accelerator, cfg, run_dir, ds, name, wandb_id)
    status, message, failure = "ok", None, None
    try:
        if accelerator.num_processes != int(cfg.resolved.world_size):
            raise TrainingError(f"the launcher started {accelerator.num_processes} processes but the DeepSpeed "
                                f"config was built for {cfg.resolved.world_size}; leave world_size unset")
        _train(cfg, ds, run_dir, accelerator, info, tracker, resume_from)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded in summary.json first
        failure = exc
        if isinstance(exc, Interrupted):
            status, message = "interrupted", str(exc)
        elif is_oom(exc):
            status, message = "oom", oom_message(cfg, info.kind)
        else:
            ours = isinstance(exc, TrainingError)
            status, message = "error", str(exc) if ours else f"{type(exc).__name__}: {exc}"
    finally:
        tracker.close()
    summary = metrics.summarize(cfg, tracker.rows, status, message, accelerator.num_processes)
    if accelerator.is_main_process:
        metrics.write_summary(run_dir, summary)
        metrics.print_summary(summary, run_dir)
    if isinstance(failure, Interrupted):
        log.warning("%s", message)
        failure.stop.forward()  # under submitit, SIGUSR2 requeues the job (and exits) from here
    if failure is None:
        _shutdown(accelerator)
    elif status in ("oom", "interrupted") or isinstance(failure, TrainingError):
        raise TrainingError(message or "") from None
    else:
        raise failure
    return summary


def is_oom(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, and the same failure as other allocators word it."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or any(
        words in text for words in ("out of memory", "not enough memory", "can't allocate memory"))


def _train(cfg: DictConfig, ds: dict[str, Any] | None, run_dir: Path, accelerator: Any, info: Any,
           tracker: metrics.Tracker, resume_from: Path | None) -> None:
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    if accelerator.is_main_process:
        _log_memory_plan(cfg, info, world)
    _prepare_nvme(cfg, accelerator)
    dataset = data.dataset(cfg, accelerator)  # before any model loads: a folder with nothing usable fails fast
    torch.manual_seed(int(cfg.train.seed))
    frozen = models.load_frozen(cfg, accelerator.state.deepspeed_plugin)
    frozen_dtype = torch.float32 if info.kind == "cpu" else torch.bfloat16
    frozen.text_encoder.to(device, frozen_dtype)
    frozen.text_encoder_2.to(device, frozen_dtype)
    frozen.vae.to(device, torch.float32 if frozen.vae.config.force_upcast or info.kind == "cpu" else frozen_dtype)
    cache = _build_cache(cfg, accelerator, dataset, frozen)
    if cache is not None and info.kind == "cuda":
        # Training reads the cache: the frozen encoders need no GPU memory from here on.
        for part in (frozen.vae, frozen.text_encoder, frozen.text_encoder_2):
            part.to("cpu")
        torch.cuda.empty_cache()
    noise_sched = models.noise_scheduler(cfg)

    unet = models.load_unet(cfg)
    ema = EMA(unet, float(cfg.train.ema_decay), "cpu" if cfg.train.ema_device == "cpu" else str(device)) \
        if cfg.train.ema else None
    optimizer, scheduler = _optimizer_and_scheduler(cfg, ds, unet.parameters())
    if ds is not None and "nvme" in (cfg.resolved.optimizer_state_on, cfg.resolved.params_on):
        _check_swap_space(cfg, accelerator)
    if scheduler is None:
        unet, optimizer = accelerator.prepare(unet, optimizer)
    else:
        unet, optimizer, scheduler = accelerator.prepare(unet, optimizer, scheduler)
    dtype = next(unet.parameters()).dtype if ds is not None else torch.float32

    start_step = 0
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        if ds is not None:
            checkpoint.restore_optimizer_clocks(accelerator.deepspeed_engine_wrapped.engine)
        start_step = int((checkpoint.complete(resume_from) or {})["step"])
        if ema is not None and (resume_from / "ema.pt").exists():
            ema.load_state_dict(torch.load(resume_from / "ema.pt", weights_only=True))
        log.info("resumed from %s at step %d", resume_from, start_step)

    micro, accum = int(cfg.train.micro_batch_size), int(cfg.train.gradient_accumulation_steps)
    max_steps, seed, n = int(cfg.train.max_steps), int(cfg.train.seed), len(dataset)
    images_per_step = micro * accum * world
    ckpt_state = {"backend": cfg.resolved.backend, "stage": int(cfg.zero.stage), "world_size": world,
                  "fingerprint": checkpoint.fingerprint(cfg), "wandb_id": tracker.wandb_id}
    progress, last_saved = None, resume_from
    if accelerator.is_main_process:
        from tqdm.auto import tqdm

        progress = tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True)
    if info.kind == "cuda":  # peaks from here on are training's (not the cache build's or DeepSpeed's setup)
        torch.cuda.reset_peak_memory_stats(device)
    with _StopRequest() as stop:
        try:
            for step in range(start_step + 1, max_steps + 1):
                step_start, data_wait, losses = time.perf_counter(), 0.0, []
                for m in range(accum):
                    b = (step - 1) * accum + m
                    fetch = time.perf_counter()
                    indices = data.batch_indices(b, rank, world, micro, n, seed)
                    batch = cache.load(indices) if cache else data.encode_batch(dataset, frozen, indices, device)
                    data_wait += time.perf_counter() - fetch
                    gen = torch.Generator().manual_seed((seed * 1_000_003 + b) * 1009 + rank)
                    with accelerator.accumulate(unet), accelerator.autocast():
                        loss = _loss(cfg, unet, noise_sched, batch, gen, device, dtype)
                        accelerator.backward(loss)
                        grad_norm = _grad_norm(unet, accelerator, ds, float(cfg.train.gradient_clipping))
                        optimizer.step()
                        optimizer.zero_grad()
                    losses.append(loss.detach())
                if scheduler is not None:
                    scheduler.step()
                if ema is not None:
                    ema.update(accelerator.unwrap_model(unet))
                # One all-reduce carries the loss and whether any rank was asked to stop.
                flag = torch.tensor(float(stop.requested), device=losses[0].device)
                mean_loss, stopping = accelerator.reduce(torch.stack([torch.stack(losses).mean().float(), flag]),
                                                         reduction="mean").tolist()
                elapsed = time.perf_counter() - step_start
                if step % int(cfg.train.log_every) == 0 or step == max_steps:
                    values: dict[str, Any] = {"loss": mean_loss, "lr": _lr(optimizer, scheduler),
                                              "s_per_it": elapsed, "data_wait_s": data_wait,
                                              "images_per_s": images_per_step / elapsed,
                                              "host_rss_peak_mib": metrics.host_rss_peak_mib(),
                                              **metrics.gpu_memory(device)}
                    if grad_norm is not None:
                        values["grad_norm"] = grad_norm
                    tracker.log(step, values)
                    if progress is not None:
                        progress.set_postfix(loss=f"{mean_loss:.4f}", s_it=f"{elapsed:.2f}",
                                             mem=_mem_text(values), refresh=False)
                if progress is not None:
                    progress.update(1)
                every = int(cfg.train.checkpoint_every)
                if (step == max_steps and cfg.train.final_checkpoint) or (every and step % every == 0) or stopping:
                    extra = {"ema": ema.state_dict()} if ema else None
                    last_saved = checkpoint.save(accelerator, run_dir, step, ckpt_state,
                                                 int(cfg.train.checkpoints_to_keep), extra)
                if stopping and step < max_steps:
                    raise Interrupted(step, last_saved, stop)
        finally:
            if progress is not None:
                progress.close()
    if cfg.train.export:
        _export(cfg, accelerator, unet, ema, frozen, run_dir)


def _lr(optimizer: Any, scheduler: Any) -> float:
    if scheduler is not None and hasattr(scheduler, "get_last_lr"):
        try:
            return float(scheduler.get_last_lr()[0])
        except (AttributeError, IndexError, TypeError):
            pass
    return float(optimizer.param_groups[0]["lr"])


def _mem_text(values: dict[str, Any]) -> str:
    if "gpu_mem_peak_allocated_mib" in values:
        return f"{values['gpu_mem_peak_allocated_mib'] / 1024:.1f}G"
    return f"rss {values['host_rss_peak_mib'] / 1024:.1f}G"


def oom_message(cfg: DictConfig, device: str) -> str:
    """One line: the memory settings of the run and what to try next."""
    zero = f"zero={ds_config.zero_option(cfg)}"
    tries = []
    if cfg.resolved.backend != "deepspeed" or int(cfg.zero.stage) < 3:
        tries.append("a higher ZeRO stage (zero=stage3)")
    if cfg.offload.device.value == "none":
        tries.append("offload=cpu")
    if int(cfg.train.micro_batch_size) > 1:
        tries.append(f"train.micro_batch_size={int(cfg.train.micro_batch_size) // 2} with more "
                     "train.gradient_accumulation_steps")
    if not cfg.train.gradient_checkpointing:
        tries.append("train.gradient_checkpointing=true")
    where = "CUDA" if device == "cuda" else device.upper()
    return (f"{where} out of memory with {zero} offload={cfg.offload.device.value} "
            f"resolution={cfg.resolution.width}x{cfg.resolution.height} "
            f"train.micro_batch_size={cfg.train.micro_batch_size} precision={cfg.precision.name.value}; try "
            + (", ".join(tries) or "a smaller resolution"))


def _shutdown(accelerator: Any) -> None:
    """Finish the trackers and destroy the process group (gloo threads left alive abort the exit)."""
    accelerator.wait_for_everyone()
    accelerator.end_training()

