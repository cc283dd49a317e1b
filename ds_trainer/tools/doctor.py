"""`python -m ds_trainer.doctor [overrides]`: before the first run, what on this machine will stop it.

One screen: versions, GPUs and their bf16, the CUDA toolkit against torch's CUDA (what DeepSpeed's fused ops
compile with), the DeepSpeed ops the configured run loads and whether each is built or can be, the pinned-memory
limit, /dev/shm, free disk where the run writes against what it will write, and the network interfaces for
several nodes. Each problem comes with its fix. Exit status 0 when the configured run can start, 2 when it
cannot; notes (a fallback that training takes by itself, a limit that may bite) do not change it.

It reads the same facts training acts on (config/toolkit.py, config/checks/): what it calls a fallback is
what the run's ds_config.json will hold, and what it calls a problem is what the run would refuse or fail at.
"""

from __future__ import annotations

import ctypes.util
import os
import platform
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

GIB = 2**30


@dataclass
class Findings:
    lines: list[str] = field(default_factory=list)  # what is here
    problems: list[tuple[str, str]] = field(default_factory=list)  # (what stops the run, the fix)
    notes: list[str] = field(default_factory=list)  # what the run works around, or may meet
    unbuildable: list[tuple[list[str], str]] = field(default_factory=list)  # (ops, fix), said

    def render(self, title: str) -> str:
        out = [title, *(f"  {line}" for line in self.lines)]
        out += [f"  note: {n}" for n in self.notes]
        fixes: dict[str, list[str]] = {}  # the problems of one fix (one cause) share its line
        for what, fix in self.problems:
            fixes.setdefault(fix, []).append(what)
        for fix, whats in fixes.items():
            out += [*(f"  PROBLEM: {what}" for what in whats), f"      fix: {fix}"]
        out.append("ds_trainer doctor: " + ("the configured run can start" if not self.problems else
                                            f"{len(self.problems)} problem(s): the configured run cannot start"))
        return "\n".join(out)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent (where a folder about to be created takes its space from)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def versions(f: Findings) -> Any:
    import torch

    f.lines.append(f"python {platform.python_version()}, torch {torch.__version__} (CUDA "
                   f"{torch.version.cuda or 'none'}), deepspeed {_version('deepspeed')}, accelerate "
                   f"{_version('accelerate')}, diffusers {_version('diffusers')}, bitsandbytes "
                   f"{_version('bitsandbytes')}")
    return torch


def gpus(f: Findings, torch: Any, cfg: DictConfig) -> None:
    if not torch.cuda.is_available():
        smi = shutil.which("nvidia-smi")
        if cfg.resolved.platform == "cuda":
            why = ("the installed torch is a CPU build" if torch.version.cuda is None else
                   "torch sees no GPU (driver not loaded, CUDA_VISIBLE_DEVICES empty, or a container without "
                   "--gpus)")
            f.problems.append((f"platform=cuda but {why}" + (" although nvidia-smi exists" if smi else ""),
                               "pip install torch --index-url https://download.pytorch.org/whl/cu128 (a CUDA "
                               "build), or run with --gpus all in a container; platform=cpu trains on the CPU"))
        f.lines.append("GPUs: none seen by torch (this run trains on the CPU)" if cfg.resolved.platform == "cpu"
                       else "GPUs: none seen by torch")
        return
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bf16 = (p.major, p.minor) >= (8, 0)
        f.lines.append(f"GPU {i}: {p.name}, {_gib(p.total_memory)}, compute {p.major}.{p.minor}, bf16 "
                       f"{'yes' if bf16 else 'NO (precision=fp16)'}")


def cuda_toolkit(f: Findings, cfg: DictConfig) -> None:
    from ds_trainer.config import toolkit

    kit = toolkit.probe()
    where = f"{kit.cuda_home} (nvcc {kit.nvcc or 'not runnable'})" if kit.cuda_home else "none found"
    state = "DeepSpeed can compile its CUDA ops" if kit.problem is None else f"cannot compile CUDA ops: {kit.problem}"
    f.lines.append(f"CUDA toolkit: {where}; torch's CUDA {kit.torch_cuda or 'none'}: {state}")
    if cfg.resolved.torch_adam:
        f.notes.append("the run uses torch's AdamW instead of DeepSpeed's FusedAdam (no toolkit to compile it; "
                       f"ds_config `torch_adam: true`, recorded in config.yaml). For the fused kernel: {kit.fix()}")


def ops(f: Findings, cfg: DictConfig) -> None:
    from ds_trainer.config import nvme, op_cache, toolkit

    wanted = toolkit.needed_ops(cfg)
    if not wanted:
        f.lines.append("DeepSpeed ops: none needed (zero=ddp runs torch's own optimizer)")
        return
    folder = op_cache.environment_folder()
    kit = toolkit.probe()
    states = []
    cannot: dict[tuple[str, str], list[str]] = {}  # (what is missing, its fix): the ops it stops
    for op in wanted:
        if toolkit.built(op, folder):
            states.append(f"{op} built")
            continue
        missing = toolkit.build_tools_missing()
        cuda_op = op in toolkit.CUDA_OPS.values() and cfg.resolved.platform == "cuda"
        if cuda_op and kit.problem:
            missing.append(f"nvcc matching torch ({kit.problem})")
        if op == "async_io" and (why := nvme.aio_prerequisites(gpu=cfg.resolved.platform == "cuda")):
            missing.append(why)
        if missing:
            states.append(f"{op} CANNOT be built")
            fix = kit.fix() if cuda_op and kit.problem else toolkit.BUILD_FIX
            cannot.setdefault(("; ".join(missing), fix), []).append(op)
        else:
            states.append(f"{op} compiles at the first run (20 s to 3 min; `make ops` does it now)")
    f.lines.append(f"DeepSpeed ops this run loads: {', '.join(states)} (folder {folder})")
    for (missing_text, fix), stopped in cannot.items():
        named = f"ops {', '.join(stopped)} are" if len(stopped) > 1 else f"op {stopped[0]} is"
        f.problems.append((f"DeepSpeed's {named} not built and cannot be: missing {missing_text}",
                           fix))
        f.unbuildable.append((stopped, fix))


def memory_limits(f: Findings, cfg: DictConfig) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    pinned = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else 0
    f.lines.append(f"pinned-memory limit (ulimit -l): {pinned}; /dev/shm: {_gib(shm)}")
    gpu = cfg.resolved.platform == "cuda"
    offload = "cpu" in (cfg.resolved.optimizer_state_on, cfg.resolved.params_on) or \
        "nvme" in (cfg.resolved.optimizer_state_on, cfg.resolved.params_on)
    if gpu and offload and soft != resource.RLIM_INFINITY and soft < 2 * GIB:
        f.notes.append(f"offload pins host memory for its copies and the limit is {pinned}: if pinning fails or is "
                       "slow, raise it (`ulimit -l unlimited`; in Docker `--ulimit memlock=-1`; under Slurm the "
                       "daemon's limit: `LimitMEMLOCK=infinity` in slurmd's unit)")
    ranks = int(cfg.resolved.world_size or 1)
    if (ranks > 1 or int(cfg.data.num_workers) > 0) and shm < GIB:
        f.notes.append(f"/dev/shm is {_gib(shm)}: NCCL between GPUs of one node and DataLoader workers use it, and "
                       "a container's default 64 MiB fails them; `docker run --shm-size=16g` (or --ipc=host)")


def disk(f: Findings, cfg: DictConfig) -> None:
    from ds_trainer.tools import plan

    one, export = plan.checkpoint_bytes(cfg)
    t = cfg.train
    periodic = int(t.checkpoint_every) > 0 or float(t.checkpoint_every_minutes) > 0
    kept = int(t.checkpoints_to_keep) + 1 if periodic else 1  # a new one is complete before the oldest goes
    need = kept * one + export
    outputs = Path(str(cfg.paths.outputs))
    free = shutil.disk_usage(_existing(outputs)).free
    f.lines.append(f"disk at {outputs}: {_gib(free)} free; the run writes up to {_gib(need)} ({kept} checkpoint(s) "
                   f"of {_gib(one)}" + (f" and an export of {_gib(export)}" if export else "") + ")")
    if need > free:
        f.problems.append((f"{outputs} has {_gib(free)} free and the run writes up to {_gib(need)}: the checkpoint "
                           "save fails on a full disk",
                           f"paths.outputs=<a folder with {_gib(need)} free>, or train.checkpoints_to_keep=1"))
    if cfg.resolved.nvme_swap_bytes:
        swap = Path(str(cfg.offload.nvme_path))
        f.lines.append(f"NVMe swap at {swap}: {_gib(shutil.disk_usage(_existing(swap)).free)} free, the run swaps "
                       f"about {_gib(int(cfg.resolved.nvme_swap_bytes))}")


def network(f: Findings) -> None:
    """The interfaces a multi-node job may use (NCCL and gloo pick one themselves unless told)."""
    addresses = []
    ip = shutil.which("ip")
    if ip:
        out = subprocess.run([ip, "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[1] != "lo":
                addresses.append(f"{parts[1]} {parts[3].split('/')[0]}")
    chosen = ", ".join(f"{k}={os.environ[k]}" for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
                       if os.environ.get(k)) or "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME unset (each picks one)"
    f.lines.append(f"network for several nodes: {', '.join(addresses) or 'no IPv4 interface but lo'}; {chosen}")
    if ctypes.util.find_library("ibverbs"):
        f.lines.append("InfiniBand verbs library present (NCCL uses it across nodes)")


def diagnose(cfg: DictConfig) -> Findings:
    """Everything above for a checked `cfg` (the config checks' problems are the first problems)."""
    f = Findings()
    torch = versions(f)
    for check in (lambda: gpus(f, torch, cfg), lambda: cuda_toolkit(f, cfg), lambda: ops(f, cfg),
                  lambda: memory_limits(f, cfg), lambda: disk(f, cfg), lambda: network(f)):
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - one check that cannot run must not hide the others
            f.notes.append(f"a check could not run: {type(exc).__name__}: {exc}")
    return f


def main(argv: list[str] | None = None) -> int:
    from ds_trainer import console
    from ds_trainer.config import checks, ds_config, op_cache, overrides, rundir, schema

    console.for_tool()
    op_cache.prepare()
    schema.register()
    rundir.register_resolvers()
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = overrides.compose_checked(args, __doc__)  # a mistake in the overrides: one screen, exit 2
    report = checks.check(cfg)
    findings = diagnose(report.cfg)
    findings.notes[:0] = list(report.warnings)
    for stopped, fix in findings.unbuildable:  # the config checks said it (checks/ops.py): once
        if any(p.fix == fix and all(op in p.why for op in stopped) for p in report.problems):
            findings.problems = [(w, x) for w, x in findings.problems
                                 if not (x == fix and stopped[0] in w)]
    findings.problems[:0] = [(f"{p.key}={p.value}: {p.why}", p.fix) for p in report.problems]
    c = report.cfg
    title = (f"ds_trainer doctor: zero={ds_config.option_name(c.resolved.backend, int(c.zero.stage))} "
             f"offload={c.offload.device.value} optimizer={c.resolved.optimizer} precision={c.precision.name.value} "
             f"on {c.resolved.platform}, {c.resolved.world_size} rank(s)")
    print(findings.render(title))
    return 2 if findings.problems else 0


if __name__ == "__main__":
    sys.exit(main())
