"""The training recipe, top to bottom: `setup` (data, frozen parts, the trained module under its backend, the resume),
`loop` (one call per optimizer step, then samples, checkpoints and validation at their named points) and `finish`
(the export). What is model-specific the run's family provides (train/families), what is backend-specific its
backend (train/backends); both are resolved once and carried by the `Run` every part reads (train/run.py). How a
run ended and what that means for the process is train/outcome.py's.

Only the trained module goes through the backend's `prepare`: the UNet or transformer, or with
`text_encoders=lora|full` that and the trained encoders as one module (adapters/text_encoders.py); the VAE and frozen
text encoders stay outside any sharding.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import hardware, rundir, source_repeats
from ds_trainer.config.problems import ConfigError
from ds_trainer.errors import TrainingError
from ds_trainer.train import backends, data, export, families, outcome
from ds_trainer.train.adapters import adapter, quantize
from ds_trainer.train.backends import accelerator as accel
from ds_trainer.train.backends import inner
from ds_trainer.train.export import card
from ds_trainer.train.families import attention, common, compiled, context, text_encoders
from ds_trainer.train.observe import metrics, startup, validate
from ds_trainer.train.observe.sampling import Sampler
from ds_trainer.train.optim import build, schedule_free
from ds_trainer.train.outcome import Outcome
from ds_trainer.train.process import op_builds, rendezvous, stop
from ds_trainer.train.process.stop import Interrupted, StopRequest
from ds_trainer.train.run import Run
from ds_trainer.train.state import checkpoint, ema, portable
from ds_trainer.train.state.resume import Resume
from ds_trainer.train.step import TrainStep

log = logging.getLogger("ds_trainer")

# Called on rank 0 at the start with (cfg, hardware info, world size): the memory planner's advice
# (cli passes `tools.plan.log_for_run`; the recipe never imports a tool).
MemoryPlan = Callable[[DictConfig, Any, int], None]


def run(cfg: DictConfig, ds: dict[str, Any] | None, run_dir: Path, name: str = "default",
        memory_plan: MemoryPlan | None = None, last: bool = True) -> dict[str, Any]:
    """Train as `cfg` says (DeepSpeed from its JSON `ds`, else FSDP2 or DDP); returns the summary, also written to
    `summary.json` whatever happens (train/outcome.py). `last`: no later run (a run's next
    phase) trains in this process, which then leaves its process group."""
    single_process_env()
    backend = backends.of(cfg, ds)
    backend.start_process()
    with stop.Immediate():  # Ctrl-C outside the training loop stops at once (recorded, no traceback)
        return _run(cfg, backend, ds, run_dir, name, memory_plan, last)


def _run(cfg: DictConfig, backend: backends.Backend, ds: dict[str, Any] | None, run_dir: Path, name: str,
         memory_plan: MemoryPlan | None, last: bool) -> dict[str, Any]:
    stop_watching_ops = op_builds.watch()  # says when DeepSpeed compiles an op; clears a dead process's lock
    nodes = rendezvous.check(cfg, run_dir)  # several nodes: all reach the master and see one run directory
    info = hardware.confirm_with_torch(hardware.detect(cfg.resolved.platform))
    kind = info.kind
    accelerator: Any = None
    tracker: metrics.Tracker | None = None
    outcome = Outcome()
    try:
        data.early_check(cfg)  # the files and headers, before Accelerate's set-up and op builds
        startup.mark("data check")
        accelerator = accel.make_accelerator(cfg, backend, kind, run_dir)
        resume = Resume.find(cfg, run_dir, accelerator)
        tracker = metrics.Tracker(accelerator, cfg, run_dir, ds, name, resume)
        if resume.path is not None:  # summary.json says what this run continued from
            tracker.add_facts({"resumed_from": resume.describe()})
        the_run = Run(cfg, accelerator, backend, families.of(cfg), run_dir, tracker, kind)
        if cfg.cache_only:
            cache_only(the_run)
        else:
            _plan_memory(the_run, info, memory_plan)
            loop(the_run, setup(the_run, resume))
            finish(the_run)
    except ConfigError:
        raise  # a refused resume: the configuration's one-screen message, before anything ran
    except (Exception, KeyboardInterrupt) as exc:  # every failure is recorded in summary.json first
        outcome = Outcome.of(exc, cfg, kind, tracker, run_dir)
    finally:
        stop_watching_ops()
        if tracker is not None:
            tracker.close()
    summary = outcome.summarize(cfg, accelerator, tracker, nodes, run_dir)
    outcome.leave(accelerator, last)
    return summary


@dataclass
class Started:
    """What `setup` hands the loop besides the run: the data, the held-out set, where the run continues."""

    loader: data.Loader
    vset: validate.ValidationSet | None
    step: int  # the last step done (0: a fresh start)
    samples: int  # the samples seen by then
    resumed_from: Path | None


def setup(run: Run, resume: Resume) -> Started:
    """Data and frozen encoders, the latent cache, the trained module under its backend, the resume point."""
    cfg, accelerator = run.cfg, run.accelerator
    # --- data and frozen parts: a folder with nothing usable fails before any model loads
    run.backend.before_build(accelerator)
    dataset = data.dataset(cfg, accelerator)
    run.tracker.add_facts({"images": len(dataset)})
    if getattr(dataset, "layout", None) is not None:
        run.tracker.add_facts({"buckets": dataset.layout.counts()})  # type: ignore[union-attr]
    torch.manual_seed(int(cfg.train.seed))
    run.frozen, encoders = _load_frozen(run)
    cache = _build_cache(run, dataset)
    vset = _validation_set(run)
    startup.mark("data, frozen encoders, cache check")
    if cache is not None and run.kind == "cuda":  # training reads the cache: the encoders need no GPU memory now
        varies = source_repeats.tags_vary(cfg)  # unless captions whose tags vary are encoded batch by batch
        for part in run.frozen.modules():
            if not (varies and any(part is encoder for encoder in run.frozen.encoders())):
                quantize.move(part, "cpu")  # an int8 encoder's LLM.int8 state with it
        torch.cuda.empty_cache()
    # --- what trains (adapter=lora: injected, the base frozen and cast), its optimizer, the backend's prepare
    where = (accelerator.device, run.params)
    run.trained = adapter.build(cfg, run.family.load_trained(cfg), encoders, where)
    model = run.trained.module
    attention.restrict(model, cfg.train.attention.value)  # train.attention: one SDPA kernel in its attention layers
    # parallel.context: each sample's sequence split over the ranks of a context group
    if run.mesh.context > 1:
        context.split(model, run.mesh, cfg.parallel.attention.value, run.family.context_plan(model))
    compiled.apply(model, cfg.train.compile.value, list(cfg.model.compile_blocks))  # train.compile, in place
    resume.before_prepare(model, run.backend)
    run.backend.before_prepare(model)
    startup.mark("model build")
    run.ema = ema.for_run(cfg, accelerator, model, run.params)
    optimizer, scheduler = build.for_run(cfg, run.backend, list(run.trained.parameters))
    if accelerator.is_main_process:
        text_encoders.describe(cfg, model)
        run.tracker.add_facts({"trained_parameters": text_encoders.counts(model)})  # summary, W&B, sweep report
    run.model, run.optimizer, run.scheduler = run.backend.prepare(accelerator, model, optimizer, scheduler)
    build.drop_unreachable_state(inner.optimizer(accelerator, run.optimizer))
    if run.scheduler is None:
        run.scheduler = build.group_schedules(cfg, run.optimizer)
    startup.mark(run.backend.init_label)
    build.check(cfg, accelerator, run.optimizer)
    run.trained.after_prepare(run)
    if run.ema is not None:  # FSDP2: the shadow as the parameters are sharded, updated from each rank's own shards
        run.ema.follow_shards(accelerator.unwrap_model(run.model))
    step, samples = resume.load(run)
    loader = data.Loader(run, dataset, cache, (step, samples))
    # Samples and exports use schedule-free AdamW's evaluation weights (checkpoints keep its training state).
    run.eval_weights = schedule_free.context(run)
    return Started(loader, vset, step, samples, resume.path)


def loop(run: Run, started: Started) -> None:
    """One call per optimizer step; samples, the checkpoint and validation after it, at the steps they are due."""
    cfg, accelerator = run.cfg, run.accelerator
    max_steps, first = int(cfg.train.max_steps), started.step
    writer = portable.Writer(run, (started.step, started.samples)) if cfg.train.portable_state else None
    saver = checkpoint.Saver(run, last=started.resumed_from, on_save=lambda: _on_save(run), also=writer)
    progress = _progress_bar(accelerator, max_steps, first)
    sampler = Sampler(run, progress)
    if run.kind == "cuda":  # peaks from here on are training's (not the cache build's or the backend's setup)
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    run.tracker.loop_start()  # the host's counterpart: the loop's own peak RSS (the tuner's CPU measure)
    with StopRequest(terminal=accelerator.is_main_process) as request:
        train_step = TrainStep(run, started.loader, request, progress, save_due=saver.due)
        validator = validate.Validator(run, started.vset, train_step.dtype) if started.vset is not None else None
        step = done = first
        try:
            if validator is not None and first == 0:
                validator.after_step(0)  # validation.at_start: the starting weights' value
            for step in range(first + 1, max_steps + 1):
                outcome = train_step(step)
                done = step
                sampler.after_step(step, outcome.stop)
                saver.after_step(step, outcome.stop, outcome.save)
                if validator is not None:  # after the checkpoint: a resume from it continues the weights trained
                    validator.after_step(step, outcome.stop)
                if outcome.stop and step < max_steps:
                    raise Interrupted(request.signum, step, saver.last, request)
        except stop.StopNow:  # a second Ctrl-C: the step in flight (or its checkpoint) is given up
            raise Interrupted(request.signum, step, saver.last, now=True) from None
        finally:
            started.loader.close()
            if progress is not None:
                progress.close()
            if accelerator.is_main_process:  # per source: images, skipped, repeats, samples seen, captions dropped
                run.tracker.add_facts({"sources": started.loader.seen(done)})


def finish(run: Run) -> None:
    """The end: what trained as LoRA in the LoRA files, what trained whole as diffusers models and single files, and
    the model card (train/export)."""
    if not run.cfg.train.export:
        return
    with run.eval_weights(), outcome.writing(run.run_dir, "exporting the trained weights"):
        if run.trained.lora:
            run.trained.export(run)
        if run.trained.full:
            export.diffusers(run)
        else:
            export.base_pipeline(run)
        if run.cfg.export.card and run.accelerator.is_main_process:
            card.write(run)
    if run.accelerator.is_main_process:
        rundir.follow_umask(run.run_dir, skip=frozenset({"checkpoints"}))


def single_process_env() -> None:
    """`python -m ds_trainer` without a launcher: a one-rank group, like torchrun would set up."""
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _plan_memory(run: Run, info: Any, memory_plan: MemoryPlan | None) -> None:
    """The launcher's world size checked, then the planner's advice on rank 0."""
    accelerator = run.accelerator
    if accelerator.num_processes != int(run.cfg.resolved.world_size):
        raise TrainingError(f"the launcher started {accelerator.num_processes} processes but the DeepSpeed "
                            f"config was built for {run.cfg.resolved.world_size}; leave world_size unset")
    if memory_plan is not None and accelerator.is_main_process:
        startup.mark("torch imports, Accelerate setup")
        # Rank 0 alone: models the planner builds must not go through ZeRO-3's zero.Init (collective).
        with run.backend.whole(accelerator):
            memory_plan(run.cfg, info, accelerator.num_processes)
    startup.mark("memory plan")


def _load_frozen(run: Run) -> tuple[Any, dict[str, torch.nn.Module]]:
    """The VAE and frozen text encoders, built whole (outside ZeRO-3), on the training device, in the precision's
    dtype (float32 on the CPU; the VAE in float32 when its config asks, as SDXL's does); and the encoders that train
    (`text_encoders=lora|full`), taken out of them in float32 (they go into the trained module)."""
    cfg, accelerator = run.cfg, run.accelerator
    frozen = run.family.load_frozen(cfg, lambda: run.backend.whole(accelerator))
    encoders = text_encoders.take(cfg, frozen)
    dtype = getattr(torch, common.frozen_dtype_name(cfg, run.kind))
    for encoder in frozen.encoders():
        encoder.to(accelerator.device, dtype)
    q = cfg.quantize
    if q.kind.value != "none" and q.text_encoders:  # what encodes the cache, the sample prompts, varying captions
        done = [quantize.apply(encoder, q.kind.value, dtype, accelerator.device, float(q.threshold))
                for encoder in frozen.encoders()]
        if done:  # none when every encoder trains
            log.info("quantize=%s: the frozen text encoders' %d linear layers as %s, %.1f MiB (%.1f MiB before)",
                     q.kind.value, sum(d.layers for d in done), quantize.KINDS[q.kind.value],
                     sum(d.after for d in done) / 2**20, sum(d.before for d in done) / 2**20)
    frozen.vae.to(accelerator.device,
                  torch.float32 if frozen.vae.config.get("force_upcast") or run.kind == "cpu" else dtype)
    return frozen, encoders


def cache_only(run: Run) -> None:
    """`cache_only=true` (`python -m ds_trainer.cache`): the checks of the images, the latent cache and the validation
    set's, each rank encoding its share; nothing trains. summary.json's `cache` says what the cache holds."""
    cfg, accelerator = run.cfg, run.accelerator
    dataset = data.dataset(cfg, accelerator)
    run.tracker.add_facts({"images": len(dataset)})
    run.frozen, _ = _load_frozen(run)
    cache = _build_cache(run, dataset)
    _validation_set(run)
    if cache is not None and accelerator.is_main_process:
        # The process's peak resident memory: what a cache build of this size needs of the host.
        run.tracker.add_facts({"cache": {"dir": str(cache.dir), "samples": len(dataset), "files": cache.files(),
                                         "packs": len(cache.packs()), "bytes": cache.disk_bytes(),
                                         "complete": cache.complete},
                               "host_rss_peak_mib": round(metrics.host_rss_peak_mib(), 1)})
        log.info("cache_only: the latent cache of %d samples is complete in %s; a run with the same data and model "
                 "reads it (data.cache_dir=%s)", len(dataset), cache.dir, cfg.data.cache_dir)


def _build_cache(run: Run, dataset: Any) -> data.LatentCache | None:
    """Every rank encodes its share of what is missing; rank 0 then marks the cache complete.

    No rank branches on whether the cache looks complete: another run may finish it between two
    ranks' looks (a sweep's cells run at once), and ranks that disagree would wait on different
    barriers forever. Encoding what is already there is a no-op.
    """
    cfg, accelerator = run.cfg, run.accelerator
    if not cfg.data.cache:
        return None
    cache = data.LatentCache(cfg, dataset, run.family, run.kind)
    start = time.time()
    with outcome.writing(run.run_dir, "building the latent cache", cache.dir):
        encoded = cache.build(dataset, run.frozen, accelerator.process_index, accelerator.num_processes,
                              accelerator.device)
    if accelerator.num_processes > 1:  # what every rank encoded (an interrupted build left the others)
        from accelerate.utils import gather_object

        encoded = sum(gather_object([encoded]))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and not cache.complete:
        cache.finish()
        size = cache.disk_bytes()
        t5 = f"; {run.family.sequence_encoder}'s sequence in bf16" if run.family.storage_dtype("prompt_embeds") else ""
        files, one = cache.files(), "clip" if run.family.spec.video else "image"
        each = f"{size / max(files, 1) / 2**10:.0f} KiB {'a' if one == 'clip' else 'an'} {one}"
        log.info("cached latents and embeddings of %d samples (%d %ss) in %.1fs: %s MiB on disk "
                 "(%s%s), %s", len(dataset), files, one, time.time() - start,
                 f"{size / 2**20:.1f}", each, t5, cache.dir)
        log.info("latent cache: %d %s(s) encoded now on %d rank(s), %d there from an earlier "
                 "build; %d pack(s)", encoded, one, accelerator.num_processes, files - encoded,
                 len(cache.packs()))
    accelerator.wait_for_everyone()
    return cache


def _validation_set(run: Run) -> validate.ValidationSet | None:
    """The held-out pairs (validation.enabled), their images cached like the training ones; described on rank 0."""
    if not run.cfg.validation.enabled:
        return None
    vset = validate.ValidationSet(run, lambda images: _build_cache(run, images))
    if run.accelerator.is_main_process:
        vset.write(run.run_dir)
        run.tracker.add_facts({"validation": vset.description})
    return vset


def _on_save(run: Run) -> None:
    """After each checkpoint: the LoRA file of the weights so far (schedule-free AdamW's evaluation weights)."""
    with run.eval_weights():
        run.trained.on_save(run)


def _progress_bar(accelerator: Any, total: int, initial: int) -> Any:
    if not accelerator.is_main_process:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
