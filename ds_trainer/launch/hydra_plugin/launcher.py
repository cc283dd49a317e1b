"""The submitit launchers of hydra-submitit-launcher, waiting on a sweep's jobs so that none is lost.

The stock launcher waits on each job's result in turn: a job cancelled with `scancel` or killed on its
node has no result, so the whole sweep stops with a traceback (or, on a cluster without accounting,
waits forever). Here every cell is watched at once; a cell whose job ended without finishing, or whose
run stopped on SIGTERM with a checkpoint (summary status `interrupted`), is submitted again into the
same cell folder, where the run resumes from its latest checkpoint into the same W&B run. A cell that
still does not finish after `max_resubmits` attempts is recorded as failed and the sweep goes on.
Ctrl-C on the sweep cancels its jobs (their runs save a checkpoint on the way out).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)

POLL_S = 2.0
# A job seen finished without a result this long is taken as lost (a result file may show up late on a
# network file system).
LOST_AFTER_S = 10.0
# A job whose result is in but that Slurm still lists as running this long after is cancelled: its srun missed the
# end of its tasks (seen on the local two-node cluster) and would hold its nodes until the time limit.
LEAVE_AFTER_S = 30.0
# squeue states of a job that may still produce a result.
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
          "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "PREEMPTED", "UNKNOWN"}


def slurm_state(job_id: str) -> str:
    """The job's state from squeue (which, unlike sacct, needs no accounting database); GONE once Slurm
    has forgotten the job."""
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    states = out.stdout.split()
    if out.returncode == 0:
        return states[0] if states else "GONE"
    return "GONE" if "Invalid job id" in out.stderr else "UNKNOWN"


def see_off(leaving: dict[int, tuple[Any, float]]) -> None:
    """`leaving`: cell number -> (its submitit job, when its result came). Forgets the jobs that left Slurm's active
    states; cancels those still active LEAVE_AFTER_S after their result (their srun missed the end of the tasks),
    so that no job of a sweep keeps its nodes once the sweep is over."""
    for num, (job, since) in list(leaving.items()):
        state = slurm_state(str(job.job_id))  # squeue, not sacct's cached answer
        if state not in ACTIVE:
            del leaving[num]
        elif time.time() - since >= LEAVE_AFTER_S:
            job.cancel(check=False)
            log.warning(f"cell #{num}: job {job.job_id} was still {state} {LEAVE_AFTER_S:.0f} s after its result; "
                        f"cancelled it (scancel) so that it frees its nodes now rather than at its time limit")
            del leaving[num]


def log_tail(path: Path, lines: int = 12) -> str:
    """The last lines of a job's log, indented under the launcher's message ('' when there is none)."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError:
        return ""
    return "".join(f"\n    {line}" for line in text.splitlines()[-lines:]) if text else ""


@dataclass
class _Cell:
    args: tuple[Any, ...]  # what the job is called with: overrides, dir key, job number, id, singletons
    job: Any
    attempt: int = 1
    lost_since: float | None = None
    result: JobReturn | None = None

    @property
    def num(self) -> int:
        return int(self.args[2])


class _Resubmitting(submitit_launcher.BaseSubmititLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        executor, resubmits = self._executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        args = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            args.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*args, strict=True))
        cells = [_Cell(a, job) for a, job in zip(args, jobs, strict=True)]
        try:
            self._wait(executor, cells, resubmits)
        except KeyboardInterrupt:
            cancelled = [cell.job for cell in cells if cell.result is None]
            for job in cancelled:
                job.cancel(check=False)
            ids = " ".join(str(job.job_id) for job in cancelled)
            print(f"ds_trainer: sweep interrupted; cancelled job(s) {ids} (each run saves a checkpoint on the way "
                  f"out; the cell folders under {self.config.hydra.sweep.dir} keep them)", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        return [cell.result for cell in cells if cell.result is not None]

    def _executor(self) -> tuple[Any, int]:
        """submitit's executor with the launcher's parameters, as the stock launcher sets it up."""
        import submitit

        params = dict(self.params)
        resubmits = int(params.pop("max_resubmits", 0))
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        return executor, resubmits

    def _wait(self, executor: Any, cells: list[_Cell], resubmits: int) -> None:
        pending = list(cells)
        leaving: dict[int, tuple[Any, float]] = {}  # cells with a result whose job Slurm may still list
        while pending or leaving:
            see_off(leaving)
            for cell in list(pending):
                outcome = self._outcome(cell)
                if outcome is None:
                    continue
                if outcome == "done" and not self._has_result(cell):
                    outcome = "lost"  # over (sacct or the local process says so) but killed before a result
                # Killed mid-run (no summary yet, or the one an earlier SIGTERM left) or stopped on SIGTERM:
                # worth another attempt. A run that failed on its own (oom, error) would fail again.
                # `lost`: a rank of a multi-node run saw another rank die (kill -9 on one node).
                status = self._summary(cell).get("status")
                if (status in ("interrupted", "lost") or (outcome == "lost" and status is None)) and \
                        cell.attempt <= resubmits:
                    why = "stopped on a signal with a checkpoint" if status == "interrupted" else \
                        "lost a rank" if status == "lost" else f"ended {self._state(cell.job)} without a result"
                    old = cell.job.job_id
                    self._clear(cell, why)
                    cell.job = executor.submit(self, *cell.args)
                    cell.attempt += 1
                    cell.lost_since = None
                    log.warning(f"cell #{cell.num}: job {old} {why}; submitted again as job {cell.job.job_id} "
                                f"(attempt {cell.attempt} of {resubmits + 1}); it resumes from its latest checkpoint")
                    continue
                cell.result = self._result(cell, outcome)
                pending.remove(cell)
                if self._EXECUTOR == "slurm":
                    leaving[cell.num] = (cell.job, time.time())
            if pending or leaving:
                time.sleep(POLL_S)

    def _clear(self, cell: _Cell, why: str) -> None:
        """Before a cell's job is submitted again: cancels the old one if Slurm still lists it as running (a lost rank's
        srun may wait for that task's end until the time limit), so that it does not hold the nodes the new job
        needs; a job already completing is left to finish."""
        if self._EXECUTOR != "slurm":
            return
        state = slurm_state(str(cell.job.job_id))
        if state not in ACTIVE or state == "COMPLETING":
            return
        cell.job.cancel(check=False)
        log.warning(f"cell #{cell.num}: job {cell.job.job_id} {why} but Slurm still listed it {state}; "
                    f"cancelled it (scancel) so that it frees its nodes for the job that replaces it")

    def _outcome(self, cell: _Cell) -> str | None:
        """`done` (the job left a result), `lost` (it ended without one) or None (not over yet)."""
        if cell.job.done():
            return "done"
        if self._EXECUTOR != "slurm":
            return None
        now = time.time()
        if self._state(cell.job) in ACTIVE:
            # submitit counts a job of several tasks done once every task has its result. When one task's rank was
            # killed (kill -9, the OOM killer, its node lost), rank 0 fails, says so and leaves its result, while
            # srun may wait for the lost task until the time limit (seen on the two-node cluster): the job is over
            # with rank 0's result; the launcher cancels it if it is submitted again, else sees it off.
            if not cell.job.task(0).done():
                return None
            cell.lost_since = cell.lost_since or now
            return "done" if now - cell.lost_since >= LOST_AFTER_S else None
        cell.lost_since = cell.lost_since or now
        return "lost" if now - cell.lost_since >= LOST_AFTER_S else None

    @staticmethod
    def _has_result(cell: _Cell) -> bool:
        from submitit.core.utils import UncompletedJobError

        try:
            cell.job.task(0).results()  # rank 0's: its run writes the summary (a lost rank may have none)
        except UncompletedJobError:
            return False
        except Exception:  # noqa: BLE001 - the job raised: that is its result
            return True
        return True

    @staticmethod
    def _state(job: Any) -> str:
        state = str(job.state).upper()  # from sacct; UNKNOWN on a cluster without accounting
        return slurm_state(job.job_id) if state == "UNKNOWN" else state

    def _cell_config(self, cell: _Cell) -> Any:
        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(cell.args[0]))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = cell.num
        return cfg

    @staticmethod
    def _cell_dir(cfg: Any) -> Path:
        return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)

    def _summary(self, cell: _Cell) -> dict[str, Any]:
        path = self._cell_dir(self._cell_config(cell)) / "summary.json"
        try:
            summary: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return summary

    def _result(self, cell: _Cell, outcome: str) -> JobReturn:
        """The cell's JobReturn; a job that failed outside the run is recorded in the cell's summary."""
        if outcome == "done":
            try:
                result: JobReturn = cell.job.task(0).results()[0]
                if result.status != JobStatus.FAILED:
                    return result
                # The task raised (a multi-node run whose ranks could not meet, or that do not share the run
                # directory): its message is recorded here, in the folder as the launcher sees it.
                message = str(result._return_value)
            except Exception as exc:  # noqa: BLE001 - one cell's failure must not end the sweep
                message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        else:
            message = (f"job {cell.job.job_id} ended {self._state(cell.job)} without a result "
                       f"after {cell.attempt} attempt(s); its log: {cell.job.paths.stderr}")
        log.error(f"cell #{cell.num}: {message}{log_tail(cell.job.paths.stderr)}")
        from ds_trainer.launch import sweep

        cfg = self._cell_config(cell)
        run_dir = self._cell_dir(cfg)
        sweep.failed_cell(cfg, run_dir, "error", message)
        return JobReturn(overrides=list(cell.args[0]), working_dir=str(run_dir), status=JobStatus.COMPLETED,
                         _return_value=None)


class LocalLauncher(_Resubmitting):
    _EXECUTOR = "local"


class SlurmLauncher(_Resubmitting):
    _EXECUTOR = "slurm"
