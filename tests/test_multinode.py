"""Multi-node: one DeepSpeed job across the two nodes of the local Slurm cluster
(`python -m ds_trainer.slurm_local start --nodes 2`: each node a slurmd in a network namespace of its own,
at 10.213.7.1 and 10.213.7.2). Every test name contains `node`: `pytest -k node` selects them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import numerics
from helpers.cli import run_cli
from helpers.deps import require
from helpers.procs import wait_until
from helpers.slurm import ACTIVE_STATES, slurm_jobs

from ds_trainer.launch import netns, slurm_local

TWO_NODES = "hydra/launcher=slurm_localtest_2nodes"
FAST = ["logger=none", "train.max_steps=3", "data.num_samples=4"]


@pytest.fixture(scope="session")
def two_nodes() -> Iterator[dict[str, str]]:
    """The two-node cluster, shared by the tests; the environment its clients need (SLURM_CONF)."""
    require(not slurm_local.missing(), f"Slurm is not installed ({', '.join(slurm_local.missing())})")
    require(os.geteuid() == 0, "the local SLURM cluster needs root")
    tools = [t for t in ("ip", "nsenter", "unshare") if shutil.which(t) is None]
    require(not tools, f"not installed: {', '.join(tools)} (Debian's iproute2 and util-linux)")
    folder = slurm_local.default_dir(2)
    running = slurm_local.running(folder)
    slurm_local.start(folder, nodes=2)
    yield slurm_local.env(folder)
    if not running:  # leave a cluster the user had started alone
        slurm_local.stop(folder)


def _cell_dirs(root: Path, marker: str = "summary.json") -> list[Path]:
    return sorted(p.parent for p in (root / "outputs" / "sweeps").glob(f"*/*/*/{marker}"))


def _steps(cell: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (cell / "metrics.jsonl").read_text().splitlines()]


def _unet(cell: Path) -> dict:
    """The exported UNet's (or a transformer's) weights."""
    from safetensors.torch import load_file

    (weights,) = [w for folder in ("unet", "transformer") for w in (cell / folder).glob("*.safetensors")]
    return load_file(weights)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model", ["sdxl_tiny", pytest.param("flux_tiny", marks=pytest.mark.long),
                                   pytest.param("wan_tiny parallel.context=2", marks=pytest.mark.long)])
def test_zero3_and_fsdp_across_two_nodes_equal_a_single_node_two_rank_run(tmp_path: Path, two_nodes: dict[str, str],
                                                                          model: str) -> None:
    """ZeRO-3 and FSDP2's full shard, each one job across the two nodes (ZeRO-2 crosses them in the tests below); SDXL
    here, in `make test-long` Flux's transformer (its two block kinds as FSDP's units) and a Wan clip's sequence
    split over the two nodes (parallel.context=2: Ulysses' all-to-all over TCP)."""
    model, *more = model.split()
    multi, single = tmp_path / "multi", tmp_path / "single"
    multi.mkdir(), single.mkdir()
    cells = "zero=stage3,fsdp_full_shard"
    # The single-node reference (two ranks on this machine, submitit-local) runs meanwhile.
    reference = subprocess.Popen([sys.executable, "-m", "ds_trainer", "-m", cells, f"model={model}", *more,
                                  "hydra/launcher=local_2proc", *FAST], cwd=single, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    result = run_cli("-m", cells, f"model={model}", *more, TWO_NODES, *FAST, cwd=multi, env=two_nodes, timeout=900)
    _, err = reference.communicate(timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert reference.returncode == 0, err[-3000:]
    cells, references = _cell_dirs(multi), _cell_dirs(single)
    assert len(cells) == len(references) == 2
    for cell, ref in zip(cells, references, strict=True):
        summary = json.loads((cell / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["world_size"] == 2
        assert summary["nodes"] == ["dsnode1", "dsnode2"] and summary["num_nodes"] == 2
        assert _steps(cell) == [1, 2, 3]  # one run directory: rank 0 alone wrote the metrics
        log_text = (cell / "ds_trainer.log").read_text()
        assert re.search(r"all 2 ranks met at dsnode1:\d+ on nodes dsnode1, dsnode2", log_text)
        if more:  # one sample's sequence over both nodes, one data stream
            assert "split over 2 ranks (ulysses attention), 1 data stream(s)" in log_text
        assert abs(summary["final_loss"] - json.loads((ref / "summary.json").read_text())["final_loss"]) < 1e-4
        ours, theirs = _unet(cell), _unet(ref)
        assert ours.keys() == theirs.keys()
        # One node all-reduces through shared memory (DeepSpeed's op) or gloo, two nodes through gloo over TCP: the same
        # gradients summed in another order (measured at most 2.5e-6 apart after 3 steps here), which Adam can turn
        # into lr-sized steps of a few near-zero-gradient elements on another CPU: the mean difference is the
        # measure (tests/helpers/numerics.py); a wrong step, LR or rank moves it by ~1e-4.
        numerics.assert_same_weights(ours, theirs, f"{cell.name}, two nodes against one", tolerance=2e-6)
    # Each rank ran on its own node, with its own address.
    outs = "".join(p.read_text() for p in cells[0].parent.glob(".submitit/*/*_log.out"))
    assert "hostname=dsnode1" in outs and "hostname=dsnode2" in outs
    assert not slurm_jobs(two_nodes, multi, ACTIVE_STATES)  # the sweep is over: none of its jobs holds the nodes


def _start(workdir: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    # fp32: about jobs that stop and come back; a bf16 step is emulated on an AVX2-only CPU, 3.5 times fp32's
    return subprocess.Popen([sys.executable, "-m", "ds_trainer", "-m", "zero=stage2", TWO_NODES, "logger=none",
                             "data.num_samples=8", "train.checkpoint_every=5", "precision=fp32", *args], cwd=workdir,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _job_after_checkpoint(workdir: Path, env: dict[str, str], proc: subprocess.Popen, step: int) -> str:
    """The running job's id once the cell has a complete checkpoint at `step`."""
    wait_until(lambda: list(workdir.glob(f"outputs/sweeps/*/*/0/checkpoints/step_{step:08d}/COMPLETE")),
               f"no step-{step} checkpoint before the job ended", proc=proc, deadline=time.time() + 600)
    (job,) = slurm_jobs(env, workdir)
    return job


def _job_processes(job: str) -> Iterator[tuple[int, list[str], dict[str, str]]]:
    """(pid, argv, environment) of this machine's processes of Slurm job `job`: every node's processes are this
    machine's, so /proc shows them all."""
    for proc in Path("/proc").iterdir():
        try:
            env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
            argv = (proc / "cmdline").read_text().split("\0")
        except (OSError, ValueError):
            continue
        if env.get("SLURM_JOB_ID") == job:
            yield int(proc.name), argv, env


def _task_pid(job: str, node: str) -> int:
    """The pid of the job's task (the rank's Python process) on `node`."""
    for pid, argv, env in _job_processes(job):
        if env.get("SLURMD_NODENAME") == node and env.get("SLURM_STEP_ID") == "0" and \
                any("submitit.core._submit" in a for a in argv):
            return pid
    raise AssertionError(f"no task of job {job} on {node}")


def _srun_pids(job: str) -> list[int]:
    """The pids of the job's srun (the batch script's, and the helper it forks)."""
    pids = [pid for pid, argv, _ in _job_processes(job) if Path(argv[0]).name == "srun"]
    assert pids, f"no srun of job {job}"
    return pids


def _starts_per_node(cell: Path) -> dict[str, int]:
    """How many times a rank started on each node (from submitit's task logs)."""
    text = "".join(p.read_text() for p in cell.parent.glob(".submitit/*/*_log.out"))
    return {n: len(re.findall(rf"Starting with JobEnvironment\(.*hostname={n}", text)) for n in ("dsnode1", "dsnode2")}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # one node's USR2 requeue and scancel run by default (test_sweeps.py), two nodes' kill -9 too
def test_a_two_node_job_at_its_time_limit_signal_or_scancelled_comes_back_and_resumes_on_both_nodes(
        tmp_path: Path, two_nodes: dict[str, str]) -> None:
    # SIGUSR2 is what Slurm sends both nodes' tasks ahead of the time limit (submitit asks for it): the
    # ranks agree to stop after the same step, save, and submitit requeues the whole job (same job id).
    # Then scancel (SIGTERM on both nodes): the ranks save again, and the launcher submits the job anew.
    proc = _start(tmp_path, two_nodes, "train.max_steps=25")
    job = _job_after_checkpoint(tmp_path, two_nodes, proc, 5)
    subprocess.run(["scancel", "--signal=USR2", job], env=two_nodes, check=True)
    cell = wait_until(lambda: next((c for c in _cell_dirs(tmp_path, "metrics.jsonl") if "resumed from" in
                                    (c / "ds_trainer.log").read_text() and len(_steps(c)) >= 12), None),
                      "the requeued job did not get going", proc=proc, deadline=time.time() + 600)
    subprocess.run(["scancel", job], env=two_nodes, check=True)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert re.search(rf"cell #0: job {job} stopped on a signal with a checkpoint; submitted again as job \d+", err)
    log_text = (cell / "ds_trainer.log").read_text()
    stops = [int(m) for m in re.findall(r"stopped by SIG(?:USR2|TERM) after step (\d+)", log_text)]
    starts = [int(m) for m in re.findall(r"resumed from \S+/step_\d+ at step (\d+)", log_text)]
    assert "stopped by SIGUSR2" in log_text and "stopped by SIGTERM" in log_text
    # (a SIGTERM stop is logged twice: by the run and by the cell's error line)
    assert len(starts) == 2 and sorted(set(stops)) == starts  # each instance resumed where the last one stopped
    assert _steps(cell) == list(range(1, 26))  # each step trained once, on both nodes
    assert _starts_per_node(cell) == {"dsnode1": 3, "dsnode2": 3}  # the whole job came back, twice
    summary = json.loads((cell / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["nodes"] == ["dsnode1", "dsnode2"]
    assert not slurm_jobs(two_nodes, tmp_path, ACTIVE_STATES)  # the sweep is over: none of its jobs holds a node


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget (148 s): one node's requeue (test_sweeps' USR2) and two nodes' equality run by default
def test_kill_9_of_one_node_task_brings_the_whole_two_node_job_back(tmp_path: Path,
                                                                     two_nodes: dict[str, str]) -> None:
    # One node's rank dies outright (the out-of-memory killer, a node failure): the other rank's next
    # collective fails, the job ends without a result, and the launcher submits it again on both nodes,
    # from the periodic checkpoint.
    proc = _start(tmp_path, two_nodes, "train.max_steps=20")
    job = _job_after_checkpoint(tmp_path, two_nodes, proc, 5)
    os.kill(_task_pid(job, "dsnode2"), 9)
    killed = time.time()
    # What a loaded machine showed (4 of 5 full CI runs): srun missed the killed task's end and kept the job RUNNING,
    # holding both nodes, until its time limit. Stopping srun makes that happen every time.
    for pid in _srun_pids(job):
        os.kill(pid, signal.SIGSTOP)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert re.search(rf"cell #0: job {job} lost a rank but Slurm still listed it RUNNING; cancelled it", err), \
        err[-3000:]
    assert re.search(rf"cell #0: job {job} lost a rank; submitted again as job \d+", err), err[-3000:]
    (cell,) = _cell_dirs(tmp_path)
    resumed = re.search(r"^\[([-\d]+ [:\d]+),\d+\]\[ds_trainer\]\[INFO\] - resumed from \S+/step_\d+ at step (\d+)",
                        (cell / "ds_trainer.log").read_text(), re.MULTILINE)
    assert resumed and int(resumed.group(2)) % 5 == 0 and int(resumed.group(2)) >= 5
    # The job came back at once, not at the lost job's time limit (10 minutes): on a loaded machine the lost task's
    # srun may wait for it that long, holding both nodes, while rank 0 has long said the job is over.
    back = time.mktime(time.strptime(resumed.group(1), "%Y-%m-%d %H:%M:%S")) - killed
    assert back < 300, f"the job resumed {back:.0f} s after the kill:\n{err[-3000:]}"
    assert sorted(set(_steps(cell))) == list(range(1, 21))
    assert _starts_per_node(cell) == {"dsnode1": 2, "dsnode2": 2}
    assert json.loads((cell / "summary.json").read_text())["status"] == "ok"
    assert not slurm_jobs(two_nodes, tmp_path, ACTIVE_STATES)


def _on_node(node: str, cwd: Path, *command: str) -> subprocess.Popen:
    """`command` on a node of the local cluster, as the README shows (`slurm_local exec`)."""
    return subprocess.Popen([sys.executable, "-m", "ds_trainer.slurm_local", "exec", "--nodes", "2", "--node", node,
                             "--", *command], cwd=cwd, env={**{k: v for k, v in os.environ.items() if not k.startswith(
                                 "ACCELERATE_")}, "GLOO_SOCKET_IFNAME": netns.IFNAME},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _torchrun(node_rank: int, *args: str) -> list[str]:
    return ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank), "--master-addr",
            "dsnode1", "--master-port", "29500", "-m", "ds_trainer", "zero=stage3", *FAST, *args]


def _accelerate(machine_rank: int, config: Path, *args: str) -> list[str]:
    return ["accelerate", "launch", "--config_file", str(config), "--num_machines", "2", "--machine_rank",
            str(machine_rank), "--main_process_ip", "dsnode1", "--main_process_port", "29500",
            "--deepspeed_multinode_launcher", "standard", "-m", "ds_trainer", "zero=stage3", *FAST, *args]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget: two nodes through Slurm run by default
def test_torchrun_and_accelerate_launch_across_the_two_node_addresses(tmp_path: Path,
                                                                      two_nodes: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    procs = [_on_node(f"dsnode{i + 1}", tmp_path, *_torchrun(i, f"hydra.run.dir={run_dir}")) for i in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["nodes"] == ["dsnode1", "dsnode2"]
    assert _steps(run_dir) == [1, 2, 3]
    # accelerate launch: the dry run's accelerate_config.yaml, told the machines and the main address.
    dry = run_cli("zero=stage3", "world_size=2", "dry_run=true", f"hydra.run.dir={tmp_path / 'dry'}", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]
    config = tmp_path / "dry" / "accelerate_config.yaml"
    procs = [_on_node(f"dsnode{i + 1}", tmp_path, *_accelerate(i, config, f"hydra.run.dir={tmp_path / 'accel'}"))
             for i in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    summary = json.loads((tmp_path / "accel" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["nodes"] == ["dsnode1", "dsnode2"]
    # Without hydra.run.dir each machine names the run directory from its own clock: a clear error, at once.
    procs = [_on_node(f"dsnode{i + 1}", tmp_path, *_torchrun(i, "train.seed=7")) for i in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1]  # (torchrun adds its own report of the failed rank)
    assert re.search(r"the ranks do not use one run directory: rank 0 on node dsnode1 uses \S+, rank 1 on node "
                     r"dsnode2 uses \S+\. Give every node the same one: hydra.run.dir=", errs[0]), errs[0][-2000:]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_directory_on_one_node_only_or_an_unreachable_master_fails_fast_naming_the_node(
        tmp_path: Path, two_nodes: dict[str, str]) -> None:
    setup = '"export OMP_NUM_THREADS=1","export DS_TRAINER_RENDEZVOUS_TIMEOUT_S=20"'
    local = slurm_local.local_dir(slurm_local.default_dir(2))  # a separate disk on each node
    cases = {
        # The sweep's run directories on node-local scratch (submitit's own files on the shared disk).
        "local_disk": [f"paths.outputs={local}/{tmp_path.name}", f"hydra.launcher.submitit_folder={tmp_path}/sub/%j",
                       f"hydra.launcher.setup=[{setup}]"],
        # A master address no node has (on the cluster's own private subnet).
        "no_master": [f"hydra.launcher.setup=[{setup},\"export MASTER_ADDR={netns.SUBNET}.99\"]"],
    }
    for name, args in cases.items():
        (tmp_path / name).mkdir()
        started = time.time()
        result = run_cli("-m", "zero=stage2", TWO_NODES, *FAST, *args, cwd=tmp_path / name, env=two_nodes, timeout=600)
        assert result.returncode == 1, result.stderr[-3000:]  # one failed cell
        assert time.time() - started < 300  # not Slurm's 10-minute limit
        assert "Traceback" not in result.stderr
        if name == "local_disk":
            assert re.search(r"cell #0: the run directory \S+/0 is not shared between the nodes: rank 0 on node "
                             r"dsnode1 wrote it, rank 1 on node dsnode2 does not see it\. Put paths.outputs",
                             result.stderr)
        else:
            assert re.search(rf"cell #0: node dsnode\d \(rank \d\) cannot reach the master address {netns.SUBNET}\.99:"
                             r"\d+ within 20s", result.stderr)
        assert "0 of 1 cells ok, 1 failed" in result.stderr


def test_slurm_local_refuses_zero_nodes_and_an_unknown_node() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ds_trainer.slurm_local", *args], capture_output=True, text=True,
                              timeout=60)

    zero = run("start", "--nodes", "0")
    assert zero.returncode == 2 and "--nodes 0: a cluster needs at least one node" in zero.stderr
    unknown = run("exec", "--nodes", "2", "--node", "dsnode9", "--", "true")
    assert unknown.returncode == 2 and "exec --node dsnode9: no such node" in unknown.stderr
    assert "Traceback" not in zero.stderr + unknown.stderr
