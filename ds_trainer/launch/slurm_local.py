"""A single-node SLURM cluster on localhost, from Debian's `slurmctld slurmd slurm-client munge`.

    python -m ds_trainer.slurm_local start [--dir DIR]   # prints the `export SLURM_CONF=...` to use
    python -m ds_trainer.slurm_local stop [--dir DIR]
    python -m ds_trainer.slurm_local status [--dir DIR]

For trying the SLURM path on one machine (and for the tests). Started by hand, no systemd; runs as
root. Everything lives in DIR (default /tmp/ds_trainer_slurm): keys, sockets, state, logs, pid files.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("DS_TRAINER_SLURM_DIR", "/tmp/ds_trainer_slurm"))
PACKAGES = ("slurmctld", "slurmd", "sbatch", "munged", "mungekey")

CONF = """\
ClusterName=localtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket.2,cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
EnforcePartLimits=ALL
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class ClusterError(Exception):
    """The local cluster cannot start here; the message says why and what to install."""


def missing() -> list[str]:
    """Programs of the cluster that are not installed."""
    return [p for p in PACKAGES if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]


def _run(*cmd: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip() or result.stdout}")
    return result


def _alive(pidfile: Path, name: str) -> int | None:
    """The pid in `pidfile` when that process is alive and is `name` (a stale file may point elsewhere)."""
    try:
        pid = int(pidfile.read_text().split()[0])
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        return None
    return pid if comm.startswith(name[:15]) else None


def conf_path(folder: Path = DEFAULT_DIR) -> Path:
    return folder / "slurm.conf"


def env(folder: Path = DEFAULT_DIR) -> dict[str, str]:
    """The environment clients need: without SLURM_CONF they look for DNS SRV records and fail."""
    return {**os.environ, "SLURM_CONF": str(conf_path(folder))}


def _node_state(folder: Path) -> str:
    host = socket.gethostname().split(".")[0]
    return _run("sinfo", "-h", "-n", host, "-o", "%t", check=False, env=env(folder)).stdout.strip()


def running(folder: Path = DEFAULT_DIR) -> bool:
    """Whether the cluster in `folder` is up and its node idle or busy."""
    return bool(_alive(folder / "slurmctld.pid", "slurmctld")) and _node_state(folder) in ("idle", "mix", "alloc")


def start(folder: Path = DEFAULT_DIR, timeout: float = 30) -> Path:
    """Start munged, slurmctld and slurmd (if not running); returns the slurm.conf path."""
    if os.geteuid() != 0:
        raise ClusterError("the local SLURM cluster runs its daemons as root; run this as root")
    if missing():
        raise ClusterError(f"not installed: {', '.join(missing())}; install them with "
                           "`apt-get install slurmctld slurmd slurm-client munge`")
    if running(folder):
        return conf_path(folder)
    for port in (6817, 6818):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise ClusterError(f"port {port} is taken: another Slurm is running here; stop it (`python -m "
                                   "ds_trainer.slurm_local stop --dir <its folder>`) or use it")
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    munge = folder / "munge"
    _run("install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", str(munge))
    key = munge / "munge.key"
    if not key.exists():
        _run("runuser", "-u", "munge", "--", "mungekey", "--create", f"--keyfile={key}")
        key.chmod(0o400)
    sock = munge / "munge.socket.2"
    if not _alive(munge / "munged.pid", "munged"):
        _run("runuser", "-u", "munge", "--", "munged", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}")
    cred = subprocess.run(["munge", "-S", str(sock), "-n"], capture_output=True, check=True).stdout
    subprocess.run(["unmunge", "-S", str(sock)], input=cred, capture_output=True, check=True)
    memory = re.search(r"RealMemory=(\d+)", _run("slurmd", "-C").stdout)
    host = socket.gethostname().split(".")[0]
    conf_path(folder).write_text(CONF.format(host=host, dir=folder, cpus=os.cpu_count(),
                                             memory=memory.group(1) if memory else 1024))
    if not _alive(folder / "slurmctld.pid", "slurmctld"):
        _run("slurmctld", "-f", str(conf_path(folder)))
    if not _alive(folder / "slurmd.pid", "slurmd"):
        _run("slurmd", "-f", str(conf_path(folder)))
    deadline = time.time() + timeout
    while _node_state(folder) != "idle":
        if time.time() > deadline:
            raise ClusterError(f"the node did not become idle in {timeout:.0f}s; see {folder / 'log'}")
        time.sleep(0.2)
    return conf_path(folder)


def stop(folder: Path = DEFAULT_DIR, timeout: float = 30) -> None:
    """Cancel what is left, wait for the queue to empty, then stop the daemons by their pid files."""
    if _alive(folder / "slurmctld.pid", "slurmctld"):
        _run("scancel", "--full", "--user", "root", check=False, env=env(folder))
        deadline = time.time() + timeout
        while _run("squeue", "-h", check=False, env=env(folder)).stdout.strip() and time.time() < deadline:
            time.sleep(0.2)
    for pidfile, name in (("slurmd.pid", "slurmd"), ("slurmctld.pid", "slurmctld"), ("munge/munged.pid", "munged")):
        pid = _alive(folder / pidfile, name)
        if pid:
            os.kill(pid, 15)
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.slurm_local", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the cluster keeps its files")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            conf = start(args.dir)
            print(f"export SLURM_CONF={conf}")
        elif args.action == "stop":
            stop(args.dir)
        else:
            state = _node_state(args.dir) or "down"
            print(f"node {state}; SLURM_CONF={conf_path(args.dir)}")
    except ClusterError as exc:
        print(f"slurm_local: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
