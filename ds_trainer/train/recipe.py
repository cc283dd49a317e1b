"""The training recipe, top to bottom: setup, loop, save. What is model-specific (the frozen parts and how they
encode, the trained module, the loss, the pipeline) the model's family provides (ds_trainer/families).

Only the trained module goes through `accelerator.prepare`, with the optimizer and scheduler the DeepSpeed
JSON defines (DummyOptim/DummyScheduler stand in for them): the UNet, or with `text_encoders=lora|full` the UNet
and the trained encoders as one module (train/text_encoders.py); the VAE and frozen text encoders stay out of
ZeRO. The loop's body is one call to `step.TrainStep` (micro-batches, backward, optimizer, stop
signal, metrics); checkpoints and the export come after it at named points.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import distributed, ds_config, hardware, nvme, op_cache, optimizers
from ds_trainer.config.checks import resolve
from ds_trainer.config.problems import ConfigError
from ds_trainer.errors import Stopped, TrainingError
from ds_trainer.train import (
    accel,
    adapter,
    carry,
    checkpoint,
    data,
    export,
    families,
    group_schedule,
    metrics,
    models,
    nvme_swap,
    oom,
    op_builds,
    portable,
    rendezvous,
    schedule_free,
    startup,
    stop,
    text_encoders,
    validate,
)
from ds_trainer.train.ema import EMA
from ds_trainer.train.sampling import Sampler
from ds_trainer.train.step import TrainStep
from ds_trainer.train.stop import Interrupted, StopRequest

log = logging.getLogger("ds_trainer")

# Called on rank 0 at the start with (cfg, hardware info, world size): the memory planner's advice
# (cli passes `tools.plan.log_for_run`; the recipe never imports a tool).
MemoryPlan = Callable[[DictConfig, Any, int], None]


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
    """DeepSpeed builds its own optimizers and the LR schedule from its JSON (placeholders here). DDP, FSDP and the
    client optimizers (torch's AdamW, bitsandbytes' 8-bit AdamW, under any backend) are built here, with DeepSpeed's
    LR schedule classes from the same blocks, so one config owns every backend."""
    from accelerate.utils import DummyOptim, DummyScheduler

    params = list(params)
    if not params:  # DeepSpeed and torch would fail later, on an empty flat buffer or an empty parameter group
        raise TrainingError(f"optimizer={cfg.optimizer.name}: the UNet has no parameter left to train "
                            f"(adapter={cfg.adapter.method.value} froze them all); nothing was trained. Check "
                            "adapter.targets, or adapter=none for a full fine-tune")
    if ds is not None and "optimizer" in ds:
        optimizer = DummyOptim(params, lr=ds["optimizer"]["params"]["lr"])
        scheduler = DummyScheduler(optimizer) if "scheduler" in ds else None
        return optimizer, scheduler
    from deepspeed.runtime import lr_schedules

    optimizer = _torch_optimizer(cfg, params)
    schedule = ds_config.scheduler_block(cfg)
    scheduler = getattr(lr_schedules, schedule["type"])(optimizer, **schedule["params"]) if schedule else None
    return optimizer, scheduler


def _group_schedules(cfg: DictConfig, optimizer: Any) -> Any:
    """After `accelerator.prepare`, when the parameter groups warm up apart (`text_encoders.warmup_steps`): a
    schedule per group on the prepared optimizer (train/group_schedule.py), outside DeepSpeed and Accelerate."""
    blocks = ds_config.group_blocks(cfg)
    if blocks is None:
        return None
    schedules = group_schedule.GroupSchedules(optimizer, blocks, ds_config.group_lrs(cfg))
    log.info("LR schedule %s per parameter group: the UNet warms up over %d steps, the text encoders over %d",
             blocks[0]["type"], *ds_config.group_warmups(cfg))
    return schedules


def _torch_optimizer(cfg: DictConfig, params: list[Any]) -> Any:
    """The optimizer the config names, built here: torch.optim's (fused where the device has the kernel: one kernel
    over all tensors instead of a per-tensor loop, 5 ms instead of 18 ms a step for the tiny UNet on this CPU; not
    for FSDP's DTensor shards), bitsandbytes' AdamW8bit, prodigyopt's Prodigy or schedulefree's AdamW."""
    block = ds_config.optimizer_block(cfg)
    name = str(cfg.resolved.optimizer)
    if name == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **block["params"])
    if name == "prodigy":
        from prodigyopt import Prodigy

        # Sharded over several ranks each sees a part of the sums behind d: its all-reduce joins them (on CUDA
        # only; the config checks refuse the case elsewhere).
        with contextlib.redirect_stdout(io.StringIO()):  # its print() of "Using decoupled weight decay" on every rank
            return Prodigy(params, **block["params"], fsdp_in_use=resolve.partitioned_over_ranks(cfg))
    if name == "schedule_free_adamw":
        import schedulefree

        optimizer = schedulefree.AdamWScheduleFree(params, **block["params"])
        optimizer.train()  # it refuses to step otherwise; nothing moves yet (no z before the first step)
        # train() looked each parameter up in its state, a defaultdict: empty entries for tensors DeepSpeed then
        # replaces by its flat partitions, which would break DeepSpeed's state_dict (a KeyError at the checkpoint).
        for key in [key for key, state in optimizer.state.items() if not state]:
            del optimizer.state[key]
        return optimizer
    torch_class = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "Adagrad": torch.optim.Adagrad,
                   "adamw_torch": torch.optim.AdamW}[block["type"]]
    fused = {"fused": True} if cfg.resolved.backend != "fsdp" else {}
    try:
        return torch_class(params, **block["params"], **fused)
    except (RuntimeError, ValueError) as exc:  # a device without the fused kernel: torch's default loop
        log.debug("fused %s unavailable here (%s)", block["type"], exc)
        return torch_class(params, **block["params"])


def _check_optimizer(cfg: DictConfig, accelerator: Any, optimizer: Any) -> None:
    """Nothing swapped behind the user's back: the optimizer that steps is the class the config names (Accelerate
    replaces a client optimizer by DeepSpeed's CPU Adam under offload unless told not to)."""
    name = str(cfg.resolved.optimizer)
    if name not in optimizers.CLIENT_CLASS:
        return
    module, cls = optimizers.CLIENT_CLASS[name]
    base = portable._base_optimizer(accelerator, optimizer)
    got = f"{type(base).__module__}.{type(base).__name__}"
    if type(base).__name__ != cls or not type(base).__module__.startswith(module.split(".")[0]):
        raise TrainingError(f"optimizer={name}: {got} would step instead of {module}.{cls}; nothing was trained. "
                            "Please report this with the run's config.yaml")
    if accelerator.is_main_process:
        how = ""
        if cfg.resolved.backend == "deepspeed":
            how = " (a DeepSpeed client optimizer: " + ("ZeRO hands it each rank's flat partition)"
                                                        if int(cfg.zero.stage) > 0 else "per parameter)")
        log.info("optimizer %s.%s steps%s", module, cls, how)


def _prepare_nvme(cfg: DictConfig, accelerator: Any) -> None:
    """Before DeepSpeed starts: the async_io op must load, and stale swap from earlier runs must go."""
    if "nvme" not in (cfg.resolved.optimizer_state_on, cfg.resolved.params_on):
        return
    if cfg.resolved.optimizer_state_on == "nvme":
        nvme_swap.align_gradient_reads()  # DeepSpeed's swapped-gradient read misses unaligned slices
    if accelerator.local_process_index == 0:
        error = nvme.aio_load_error(gpu=torch.cuda.is_available())
        if error:
            raise TrainingError(f"offload=nvme: {error}")
        for stale in nvme.remove_stale_swap(cfg.offload.nvme_path):
            log.warning("removed stale NVMe swap folder %s (left by an earlier run; it breaks resumes)", stale)
    accelerator.wait_for_everyone()


def _check_swap_space(cfg: DictConfig, accelerator: Any) -> None:
    """Right before DeepSpeed writes its NVMe swap, check the room again: the disk may have filled up since
    the configuration was checked, and DeepSpeed does not notice a full swap disk (the files end short
    and it aborts the process on reading one back: no message, no summary)."""
    why = resolve.swap_problem(cfg) if accelerator.local_process_index == 0 else None
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
        size = cache.disk_bytes()
        log.info("cached latents and embeddings of %d samples in %.1fs: %s MiB on disk (%s KiB a sample%s), %s",
                 len(dataset), time.time() - start, f"{size / 2**20:.1f}", f"{size / max(len(dataset), 1) / 2**10:.0f}",
                 "; T5's sequence in bf16" if families.of(cfg).storage_dtype("prompt_embeds") else "", cache.dir)
    accelerator.wait_for_everyone()
    return cache


def run(cfg: DictConfig, ds: dict[str, Any] | None, run_dir: Path, name: str = "default",
        memory_plan: MemoryPlan | None = None) -> dict[str, Any]:
    """Train as `cfg` says; returns the summary, also written to `summary.json` whatever happens:
    `ok`, `oom` (with what to try next), `interrupted` (a signal, Ctrl-C), `lost` or `error` (with its message)."""
    _single_process_env()
    if ds is not None:  # this environment's compiled ops (never another venv's), no 1.1 s CPU probes per op load
        op_cache.prepare()
    else:  # DDP and FSDP load no DeepSpeed op: importing DeepSpeed to prepare its builds would only cost start-up
        op_cache.use_environment_folder()
    with stop.Immediate():  # Ctrl-C outside the training loop stops at once (recorded, no traceback)
        return _run(cfg, ds, run_dir, name, memory_plan)


def _run(cfg: DictConfig, ds: dict[str, Any] | None, run_dir: Path, name: str,
         memory_plan: MemoryPlan | None) -> dict[str, Any]:
    stop_watching_ops = op_builds.watch()  # says when DeepSpeed compiles an op; clears a dead process's lock
    # Several nodes: all ranks reach the master address and see one run directory, or a clear error now.
    nodes = rendezvous.check(cfg, run_dir)
    info = hardware.confirm_with_torch(hardware.detect(cfg.resolved.platform))
    accelerator: Any = None
    tracker: metrics.Tracker | None = None
    status, message, failure = "ok", None, None
    try:
        accelerator = accel.make_accelerator(cfg, ds, info.kind, run_dir)
        # Rank 0 decides what to resume from and tells the others: ranks looking at the file system at
        # different moments could otherwise disagree and then load different checkpoints.
        resume_from = checkpoint.resume_point(cfg, run_dir, accelerator)
        resumed = (checkpoint.complete(resume_from) or {}) if resume_from else {}
        tracker = metrics.Tracker(accelerator, cfg, run_dir, ds, name, resumed.get("wandb_id"), resumed.get("step"))
        if accelerator.num_processes != int(cfg.resolved.world_size):
            raise TrainingError(f"the launcher started {accelerator.num_processes} processes but the DeepSpeed "
                                f"config was built for {cfg.resolved.world_size}; leave world_size unset")
        if memory_plan is not None and accelerator.is_main_process:
            startup.mark("torch imports, Accelerate setup")
            # Rank 0 alone: models the planner builds must not go through ZeRO-3's zero.Init (collective).
            with models.outside_zero3(accelerator.state.deepspeed_plugin):
                memory_plan(cfg, info, accelerator.num_processes)
        startup.mark("memory plan")
        _train(cfg, ds, run_dir, accelerator, info, tracker, resume_from)
    except ConfigError:
        raise  # a refused resume: the configuration's one-screen message, before anything ran
    except (Exception, KeyboardInterrupt) as exc:  # every failure is recorded in summary.json first
        failure = exc
        signum = stop.received()
        if isinstance(exc, Interrupted):
            status, message = "interrupted", str(exc)
        elif signum is not None:
            # Ctrl-C outside the loop, or a collective broken by a rank that stopped at once: the run was stopped.
            done = tracker.rows[-1]["step"] if tracker is not None and tracker.rows else None
            last = checkpoint.checkpoints(run_dir)[-1][1] if checkpoint.checkpoints(run_dir) else None
            status, message = "interrupted", str(Interrupted(signum, done or 0, last, now=True)) if done is None \
                else f"stopped by {stop.name(signum)} after step {done} (the steps are done; what followed them was " \
                     f"not)" + (f"; checkpoint {last}" if last else "")
        elif oom.is_oom(exc):
            status, message = "oom", oom.message(cfg, info.kind)
        elif rendezvous.peer_lost(exc):  # another node's rank died: the launcher brings the whole job back
            status, message = "lost", rendezvous.lost_message(exc)
        else:
            ours = isinstance(exc, TrainingError)
            status, message = "error", str(exc) if ours else f"{type(exc).__name__}: {exc}"
    finally:
        stop_watching_ops()
        if tracker is not None:
            tracker.close()
    world = accelerator.num_processes if accelerator is not None else int(cfg.resolved.world_size)
    summary = {**metrics.summarize(cfg, tracker.rows if tracker else [], status, message, world, nodes,
                                   validations=tracker.validations if tracker else None),
               **(tracker.facts if tracker else {})}
    if (accelerator.is_main_process if accelerator is not None else distributed.is_main()):
        metrics.write_summary(run_dir, summary)
        metrics.print_summary(summary, run_dir)
    if status == "interrupted":
        log.warning("%s", message)
        if isinstance(failure, Interrupted) and failure.stop is not None:
            failure.stop.forward()  # under submitit, SIGUSR2 requeues the job (and exits) from here
        raise Stopped(message or "", stop.exit_status(stop.received())) from None
    if failure is None:
        _shutdown(accelerator)
    elif isinstance(failure, TrainingError):
        raise failure.with_traceback(None) from None  # its class says the exit status (InputError: 2)
    elif status in ("oom", "lost"):
        raise TrainingError(message or "") from None
    else:
        raise failure
    return summary


def _train(cfg: DictConfig, ds: dict[str, Any] | None, run_dir: Path, accelerator: Any, info: Any,
           tracker: metrics.Tracker, resume_from: Path | None) -> None:
    # --- setup: data and frozen encoders, the latent cache, the UNet under DeepSpeed, the resume point
    _prepare_nvme(cfg, accelerator)
    dataset = data.dataset(cfg, accelerator)  # before any model loads: a folder with nothing usable fails fast
    if getattr(dataset, "layout", None) is not None:
        tracker.add_facts({"buckets": dataset.layout.counts()})  # type: ignore[union-attr]
    torch.manual_seed(int(cfg.train.seed))
    frozen, encoders = _load_frozen(cfg, accelerator, info.kind)
    cache = _build_cache(cfg, accelerator, dataset, frozen)
    vset = validate.ValidationSet(cfg, accelerator, frozen,
                                  lambda images: _build_cache(cfg, accelerator, images, frozen)) \
        if cfg.validation.enabled else None
    if vset is not None and accelerator.is_main_process:
        vset.write(run_dir)
        tracker.add_facts({"validation": vset.description})
    startup.mark("data, frozen encoders, cache check")
    if cache is not None and info.kind == "cuda":
        # Training reads the cache: the frozen encoders need no GPU memory from here on.
        for part in frozen.modules():
            part.to("cpu")
        torch.cuda.empty_cache()
    # adapter=lora: inject, freeze, cast the base; else the whole UNet. With trained text encoders the model is
    # the UNet and those encoders as one module (text_encoders.Denoiser), which "unet" names from here on.
    trained = adapter.build(cfg, families.of(cfg).load_trained(cfg), encoders)
    unet = trained.module
    # Under another layout than the checkpoint's (stage, offload, ranks, batch split) its portable state
    # carries over; otherwise DeepSpeed's native load (`_resume`).
    resumed = carry.Carry(cfg, resume_from)
    resumed.before_prepare(unet)
    exact = carry.Exact(cfg, ds is not None, resume_from, unet)
    if cfg.resolved.backend == "fsdp" and cfg.precision.name.value == "bf16_pure":
        unet.to(torch.bfloat16)  # FSDP2 shards the parameters as they are: bf16 masters, gradients and Adam state
    startup.mark("model build")
    ema = EMA(unet, float(cfg.train.ema_decay), "cpu" if cfg.train.ema_device == "cpu" else str(accelerator.device),
              accelerator.process_index, accelerator.num_processes, accelerator.device) if cfg.train.ema else None
    if ema is not None and accelerator.num_processes > 1 and accelerator.is_main_process:
        whole = sum(torch.Size(s).numel() for s in ema.shapes.values()) * 4 / 2**20
        mine = sum(v.numel() for v in ema.shadow.values()) * 4 / 2**20
        log.info("EMA (%.0f MiB in fp32) sharded over %d ranks: rank 0 keeps and updates %.0f MiB of it",
                 whole, accelerator.num_processes, mine)
    optimizer, scheduler = _optimizer_and_scheduler(cfg, ds, trained.parameters)
    if accelerator.is_main_process:
        text_encoders.describe(cfg, unet)
        tracker.add_facts({"trained_parameters": text_encoders.counts(unet)})  # summary.json, W&B, sweep report
    if ds is not None and "nvme" in (cfg.resolved.optimizer_state_on, cfg.resolved.params_on):
        _check_swap_space(cfg, accelerator)
    if scheduler is None:
        unet, optimizer = accelerator.prepare(unet, optimizer)
        scheduler = _group_schedules(cfg, optimizer)
    else:
        unet, optimizer, scheduler = accelerator.prepare(unet, optimizer, scheduler)
    exact.after_prepare(accelerator, unet, optimizer)
    startup.mark({"deepspeed": "DeepSpeed init", "fsdp": "FSDP init"}.get(cfg.resolved.backend, "DDP init"))
    _check_optimizer(cfg, accelerator, optimizer)
    trained.after_prepare(accelerator, unet)
    if ema is not None:  # FSDP2: the shadow as the parameters are sharded, updated from each rank's own shards
        ema.follow_shards(accelerator.unwrap_model(unet))
    after_native_load = _checkpoint_schedule(accelerator, ds, scheduler, None if resumed.changed else resume_from)
    start_step = resumed.after_prepare(accelerator, unet, optimizer, scheduler, ema) if resumed.changed \
        else _resume(accelerator, ds, ema, resume_from, trained.load_kwargs(ds is not None))
    if not resumed.changed and resume_from is not None:
        after_native_load(resume_from)
        resumed.after_native_load()
    start = resumed.start(start_step, int(cfg.train.micro_batch_size) * int(cfg.train.gradient_accumulation_steps)
                          * accelerator.num_processes)
    loader = data.Loader(cfg, dataset, cache, frozen, accelerator.process_index, accelerator.num_processes,
                         accelerator.device, start)
    max_steps = int(cfg.train.max_steps)
    # Samples and exports use schedule-free AdamW's evaluation weights (checkpoints keep its training state).
    eval_weights = schedule_free.context(cfg, accelerator, unet, optimizer)

    def on_save() -> None:
        with eval_weights():
            trained.on_save(accelerator, unet, ema, run_dir)

    saver = checkpoint.Saver(cfg, accelerator, run_dir, ema, wandb_id=tracker.wandb_id, last=resume_from,
                             save_kwargs=trained.save_kwargs(ds is not None), on_save=on_save,
                             also=portable.Writer(cfg, accelerator, unet, optimizer, scheduler, start)
                             if cfg.train.portable_state else None)
    progress = _progress_bar(accelerator, max_steps, start_step)
    sampler = Sampler(cfg, accelerator, unet, ema, frozen, run_dir, tracker, progress, eval_weights)
    if info.kind == "cuda":  # peaks from here on are training's (not the cache build's or DeepSpeed's setup)
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    tracker.loop_start()  # the host's counterpart: the loop's own peak RSS (the tuner's CPU measure)

    # --- the loop: one call per optimizer step
    with StopRequest(terminal=accelerator.is_main_process) as request:
        train_step = TrainStep(cfg, accelerator, unet, optimizer, scheduler, ema, families.of(cfg).schedule(cfg),
                               loader, request, tracker, progress, deepspeed=ds is not None, save_due=saver.due)
        validator = validate.Validator(cfg, accelerator, unet, ema, vset, tracker, train_step.dtype, eval_weights) \
            if vset is not None else None
        step = start_step
        try:
            if validator is not None and start_step == 0:
                validator.after_step(0)  # validation.at_start: the starting weights' value
            for step in range(start_step + 1, max_steps + 1):
                outcome = train_step(step)
                sampler.after_step(step, outcome.stop)
                saver.after_step(step, outcome.stop, outcome.save)
                if validator is not None:  # after the checkpoint: a resume from it continues the weights trained
                    validator.after_step(step, outcome.stop)
                if outcome.stop and step < max_steps:
                    raise Interrupted(request.signum, step, saver.last, request)
        except stop.StopNow:  # a second Ctrl-C: the step in flight (or its checkpoint) is given up
            raise Interrupted(request.signum, step, saver.last, now=True) from None
        finally:
            loader.close()
            if progress is not None:
                progress.close()

    # --- the end: the model in diffusers format (what trained as LoRA in the LoRA file, the rest as models)
    if cfg.train.export:
        with eval_weights():
            if trained.lora:
                trained.export(accelerator, unet, ema, run_dir)
            if trained.full:
                export.diffusers(cfg, accelerator, unet, optimizer, ema, frozen, run_dir)
            else:
                export.base_pipeline(cfg, accelerator, frozen, run_dir)


def _load_frozen(cfg: DictConfig, accelerator: Any, kind: str) -> tuple[Any, dict[str, torch.nn.Module]]:
    """The VAE and frozen text encoders, outside ZeRO-3, on the training device, in the precision's dtype (float32
    on the CPU; the VAE in float32 when its config asks, as SDXL's does); and the encoders that train
    (`text_encoders=lora|full`), taken out of them in float32 (they go into the trained module)."""
    frozen = families.of(cfg).load_frozen(cfg, accelerator.state.deepspeed_plugin)
    encoders = text_encoders.take(cfg, frozen)
    dtype = getattr(torch, models.frozen_dtype_name(cfg, kind))
    for encoder in frozen.encoders():
        encoder.to(accelerator.device, dtype)
    frozen.vae.to(accelerator.device, torch.float32 if frozen.vae.config.force_upcast or kind == "cpu" else dtype)
    return frozen, encoders


def _checkpoint_schedule(accelerator: Any, ds: dict[str, Any] | None, scheduler: Any,
                         native_from: Path | None) -> Callable[[Path], None]:
    """Without DeepSpeed (DDP, FSDP) the LR schedule is one of DeepSpeed's classes, which Accelerate does not
    take for a scheduler and would not save: it is registered as a checkpoint object; so are the per-group
    schedules under every backend (`_group_schedules`). Returns what to do after a
    native load: put the LR of the resumed position into the optimizer (from the registered object, or for a
    checkpoint written before it was registered, from its portable state)."""
    if scheduler is None or (ds is not None and not isinstance(scheduler, group_schedule.GroupSchedules)):
        return lambda _: None  # none, or DeepSpeed's engine steps and saves it
    registered = native_from is None or (native_from / "custom_checkpoint_0.pkl").exists()
    if registered:
        accelerator.register_for_checkpointing(scheduler)

    def after_load(folder: Path) -> None:
        if not registered:
            saved = folder / "portable" / "scheduler.pt"
            if saved.exists():
                scheduler.load_state_dict(torch.load(saved, map_location="cpu", weights_only=False))
            accelerator.register_for_checkpointing(scheduler)  # saved with every checkpoint from now on
        scheduler.step(scheduler.last_batch_iteration)  # the LR of the resumed position
    return after_load


def _resume(accelerator: Any, ds: dict[str, Any] | None, ema: EMA | None, resume_from: Path | None,
            load_kwargs: dict[str, Any]) -> int:
    """Load a checkpoint (DeepSpeed's native load); returns the step it was saved at (0: a fresh start)."""
    if resume_from is None:
        return 0
    accelerator.load_state(str(resume_from), **load_kwargs)
    if ds is not None:
        checkpoint.restore_optimizer_clocks(accelerator.deepspeed_engine_wrapped.engine)
    start_step = int((checkpoint.complete(resume_from) or {})["step"])
    if ema is not None and (resume_from / "ema.pt").exists():
        # Memory-mapped: each rank reads the pages of its own slice, not the whole EMA.
        ema.load_state_dict(torch.load(resume_from / "ema.pt", map_location="cpu", weights_only=True, mmap=True))
    log.info("resumed from %s at step %d", resume_from, start_step)
    return start_step


def _progress_bar(accelerator: Any, total: int, initial: int) -> Any:
    if not accelerator.is_main_process:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)


def _shutdown(accelerator: Any) -> None:
    """Finish the trackers and destroy the process group (gloo threads left alive abort the exit)."""
    accelerator.wait_for_everyone()
    accelerator.end_training()

