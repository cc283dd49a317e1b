"""A SLURM cluster on localhost, from Debian's `slurmctld slurmd slurm-client munge`.

    python -m ds_trainer.slurm_local start [--nodes N] [--dir DIR]   # prints the `export SLURM_CONF=...`
    python -m ds_trainer.slurm_local stop [--nodes N] [--dir DIR]
    python -m ds_trainer.slurm_local status [--nodes N] [--dir DIR]

For trying the SLURM path on one machine (and for the tests). Started by hand, no systemd; runs as
root. Everything lives in DIR (default /tmp/ds_trainer_slurm, /tmp/ds_trainer_slurm_Nnodes for N > 1):
keys, sockets, state, logs, pid files. With one node, slurmd is the host itself (127.0.0.1). With
N > 1, each node `dsnode<i>` is a slurmd in a network namespace of its own, at 10.213.7.<i> on a private
bridge (launch/netns.py), with its own hostname; slurmctld listens on the bridge (10.213.7.254) on
ports 6837/6838, so a one-node cluster (6817/6818) can run beside it. munge's socket is a file in DIR,
which every namespace sees: the shared file system of a real cluster is this machine's.
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

from ds_trainer.launch import netns

DEFAULT_DIR = Path(os.environ.get("DS_TRAINER_SLURM_DIR", "/tmp/ds_trainer_slurm"))
PACKAGES = ("slurmctld", "slurmd", "sbatch", "munged", "mungekey")

CONF = """\
ClusterName=localtest
SlurmctldHost={host}({ctld_addr})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket.2,cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool{node_suffix}
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd{node_suffix}.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd{node_suffix}.log
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
{node_lines}
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


def default_dir(nodes: int = 1) -> Path:
    """Where a cluster of `nodes` nodes keeps its files unless --dir says otherwise."""
    return DEFAULT_DIR if nodes == 1 else DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}_{nodes}nodes")


def local_dir(folder: Path) -> Path:
    """A folder that is a separate disk on each node of a multi-node cluster (node-local scratch)."""
    return folder / "local"


def cluster_nodes(folder: Path) -> list[netns.Node]:
    """The namespaced nodes of the cluster in `folder` (none for a one-node cluster on the host)."""
    path = folder / "nodes"
    return netns.nodes(int(path.read_text())) if path.exists() else []


def node_names(folder: Path) -> list[str]:
    return [n.name for n in cluster_nodes(folder)] or [socket.gethostname().split(".")[0]]


def node_states(folder: Path) -> list[str]:
    """Each node's state from sinfo (`idle`, `alloc`, ...; `down` when it is not reporting)."""
    names = node_names(folder)
    out = _run("sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N %t", check=False, env=env(folder)).stdout
    states = dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
    return [states.get(name, "down") for name in names]


def running(folder: Path = DEFAULT_DIR) -> bool:
    """Whether the cluster in `folder` is up and all its nodes idle or busy."""
    return bool(_alive(folder / "slurmctld.pid", "slurmctld")) and \
        all(state in ("idle", "mix", "alloc") for state in node_states(folder))


def _conf(folder: Path, nodes: int) -> str:
    memory = re.search(r"RealMemory=(\d+)", _run("slurmd", "-C").stdout)
    host = socket.gethostname().split(".")[0]
    common = {"cpus": os.cpu_count(), "memory": memory.group(1) if memory else 1024}
    line = "NodeName={name} NodeAddr={addr} CPUs={cpus} RealMemory={memory} State=UNKNOWN"
    if nodes == 1:
        return CONF.format(host=host, dir=folder, ctld_addr="127.0.0.1", port=6817, slurmd_port=6818, node_suffix="",
                           node_lines=line.format(name=host, addr="127.0.0.1", **common))
    lines = "\n".join(line.format(name=n.name, addr=n.addr, **common) for n in netns.nodes(nodes))
    # %n: each slurmd gets its own spool, pid file and log (they share the file system).
    return CONF.format(host=host, dir=folder, ctld_addr=netns.HOST_ADDR, port=6837, slurmd_port=6838,
                       node_suffix="-%n", node_lines=lines)


def _start_munge(folder: Path) -> None:
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


def start(folder: Path = DEFAULT_DIR, timeout: float = 30, nodes: int = 1) -> Path:
    """Start munged, slurmctld and a slurmd per node (if not running); returns the slurm.conf path. A controller
    started here starts with an empty queue."""
    if os.geteuid() != 0:
        raise ClusterError("the local SLURM cluster runs its daemons as root; run this as root")
    if missing():
        raise ClusterError(f"not installed: {', '.join(missing())}; install them with "
                           "`apt-get install slurmctld slurmd slurm-client munge`")
    if (folder / "nodes").exists() != (nodes > 1) or (nodes > 1 and len(cluster_nodes(folder)) != nodes):
        if _alive(folder / "slurmctld.pid", "slurmctld"):
            raise ClusterError(f"{folder} holds a cluster of another size; stop it first (`python -m "
                               f"ds_trainer.slurm_local stop --dir {folder}`)")
    elif running(folder):
        return conf_path(folder)
    ports = (6817, 6818) if nodes == 1 else (6837,)
    for port in ports if not _alive(folder / "slurmctld.pid", "slurmctld") else ():
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise ClusterError(f"port {port} is taken: another Slurm is running here; stop it (`python -m "
                                   "ds_trainer.slurm_local stop --dir <its folder>`) or use it")
    for sub in ("state", "spool", "log", "local"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    _start_munge(folder)
    conf_path(folder).write_text(_conf(folder, nodes))
    cluster = netns.nodes(nodes) if nodes > 1 else []
    if cluster:
        (folder / "nodes").write_text(str(nodes))
        try:
            netns.setup(cluster)
        except netns.NetnsError as exc:
            raise ClusterError(str(exc)) from None
    else:
        (folder / "nodes").unlink(missing_ok=True)
    if not _alive(folder / "slurmctld.pid", "slurmctld"):
        # `-c`: no jobs from the controller's last life. stop() cancels every job, so only a controller that died
        # (a killed process, a rebooted or snapshotted machine) leaves some in its state folder, and Slurm would
        # requeue and run them again here: someone's old training run taking the node, which then never turns idle.
        _run("slurmctld", "-c", "-f", str(conf_path(folder)))
    for node in cluster:
        (folder / f"spool-{node.name}").mkdir(exist_ok=True)
        if not _alive(folder / f"slurmd-{node.name}.pid", "slurmd"):
            _run(*netns.exec_prefix(node, local_dir(folder)), "slurmd", "-N", node.name, "-f", str(conf_path(folder)))
    if not cluster and not _alive(folder / "slurmd.pid", "slurmd"):
        _run("slurmd", "-f", str(conf_path(folder)))
    deadline = time.time() + timeout
    while any(state != "idle" for state in node_states(folder)):
        if time.time() > deadline:
            raise ClusterError(f"the nodes did not become idle in {timeout:.0f}s "
                               f"({', '.join(node_states(folder))}); see {folder / 'log'}")
        time.sleep(0.2)
    return conf_path(folder)


def _kill(pid: int | None) -> None:
    if not pid:
        return
    os.kill(pid, 15)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.05)


def stop(folder: Path = DEFAULT_DIR, timeout: float = 30) -> None:
    """Cancel what is left, wait for the queue to empty, then stop the daemons by their pid files and
    remove the nodes' namespaces, veths, bridge and /etc/hosts lines."""
    if _alive(folder / "slurmctld.pid", "slurmctld"):
        _run("scancel", "--full", "--user", "root", check=False, env=env(folder))
        deadline = time.time() + timeout
        while _run("squeue", "-h", check=False, env=env(folder)).stdout.strip() and time.time() < deadline:
            time.sleep(0.2)
    cluster = cluster_nodes(folder)
    slurmds = [f"slurmd-{n.name}.pid" for n in cluster] or ["slurmd.pid"]
    for pidfile in slurmds:
        _kill(_alive(folder / pidfile, "slurmd"))
    _kill(_alive(folder / "slurmctld.pid", "slurmctld"))
    _kill(_alive(folder / "munge" / "munged.pid", "munged"))
    if cluster:
        netns.teardown(cluster)


def _exec(folder: Path, name: str | None, command: list[str]) -> int:
    """Run `command` on a node of a multi-node cluster, as if logged in there (replaces this process)."""
    found = [n for n in cluster_nodes(folder) if n.name == name]
    if not found or not command:
        names = ", ".join(n.name for n in cluster_nodes(folder)) or "none: start one with --nodes 2"
        print(f"slurm_local: exec --node {name}: {'no such node' if not found else 'no command'} (nodes: {names}); "
              "use: exec --nodes 2 --node dsnode1 -- COMMAND", file=sys.stderr)
        return 2
    prefix = netns.exec_prefix(found[0], local_dir(folder))
    os.execvp(prefix[0], [*prefix, *command])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.slurm_local", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("start", "stop", "status", "exec"))
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (each >1 in a network namespace)")
    parser.add_argument("--dir", type=Path, default=None, help="where the cluster keeps its files")
    parser.add_argument("--node", help="exec: the node to run the command (after --) on: its network and host name")
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.nodes < 1:
        print(f"slurm_local: --nodes {args.nodes}: a cluster needs at least one node; use --nodes 1 or 2",
              file=sys.stderr)
        return 2
    folder = args.dir or default_dir(args.nodes)
    if args.action == "exec":
        return _exec(folder, args.node, command)
    try:
        if args.action == "start":
            conf = start(folder, nodes=args.nodes)
            print(f"export SLURM_CONF={conf}")
        elif args.action == "stop":
            stop(folder)
        else:
            states = " ".join(f"{name}={state}" for name, state in zip(node_names(folder), node_states(folder),
                                                                         strict=True))
            print(f"nodes {states}; SLURM_CONF={conf_path(folder)}")
    except ClusterError as exc:
        print(f"slurm_local: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
