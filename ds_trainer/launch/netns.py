"""Pretend machines on one host: network namespaces on a private bridge, for the local Slurm cluster.

Each node is a network namespace `ds_trainer_<name>` holding one end of a veth pair, named `dsn0` in
every namespace (one interface name on every node, as on a real cluster, so `GLOO_SOCKET_IFNAME=dsn0`
holds everywhere); the other end hangs on the bridge `dstbr0`, which carries the host's address on the
subnet (where slurmctld listens). Node names resolve through lines this module adds to /etc/hosts,
each marked with MARK so `teardown` removes exactly those. Everything here is made and removed by
name; nothing else on the machine is touched.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.7"  # a private /24 that nothing else here uses
BRIDGE = "dstbr0"
IFNAME = "dsn0"  # the node's interface inside its namespace
HOST_ADDR = f"{SUBNET}.254"
MARK = "# ds_trainer slurm_local"
HOSTS = Path("/etc/hosts")


class NetnsError(Exception):
    """The namespaces cannot be made here; the message says why."""


@dataclass(frozen=True)
class Node:
    name: str
    addr: str

    @property
    def netns(self) -> str:
        return f"ds_trainer_{self.name}"

    @property
    def veth(self) -> str:  # the host's end (interface names have at most 15 characters)
        return f"dstv{self.name[-4:]}"


def nodes(count: int) -> list[Node]:
    """`count` nodes named dsnode1.. with addresses .1, .2, ... on SUBNET."""
    return [Node(f"dsnode{i}", f"{SUBNET}.{i}") for i in range(1, count + 1)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(["ip", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise NetnsError("`ip` is not installed; install Debian's iproute2 (`apt-get install iproute2`)") from None
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def exists(node: Node) -> bool:
    return node.netns in _ip("netns", "list", check=False).stdout.split()


def setup(cluster: list[Node]) -> None:
    """The bridge with the host's address, a namespace per node wired to it, and /etc/hosts lines."""
    if _ip("link", "show", BRIDGE, check=False).returncode != 0:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{HOST_ADDR}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for node in cluster:
        if exists(node):
            continue
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", IFNAME, "netns", node.netns)
        _ip("link", "set", node.veth, "master", BRIDGE)
        _ip("link", "set", node.veth, "up")
        inside = ("netns", "exec", node.netns, "ip")
        _ip(*inside, "addr", "add", f"{node.addr}/24", "dev", IFNAME)
        _ip(*inside, "link", "set", IFNAME, "up")
        _ip(*inside, "link", "set", "lo", "up")
    add_hosts({node.name: node.addr for node in cluster})


def teardown(cluster: list[Node]) -> None:
    """Remove the namespaces, veths, the bridge and our /etc/hosts lines (whatever of them exists)."""
    for node in cluster:
        _ip("netns", "del", node.netns, check=False)
        _ip("link", "del", node.veth, check=False)  # normally gone with its peer's namespace
    _ip("link", "del", BRIDGE, check=False)
    remove_hosts()


def add_hosts(names: dict[str, str]) -> None:
    """Resolve each name to its address (written in place: /etc/hosts may be a bind mount)."""
    lines = [line for line in HOSTS.read_text().splitlines() if not line.endswith(MARK)]
    lines += [f"{addr} {name} {MARK}" for name, addr in names.items()]
    HOSTS.write_text("\n".join(lines) + "\n")


def remove_hosts() -> None:
    text = HOSTS.read_text()
    kept = [line for line in text.splitlines() if not line.endswith(MARK)]
    if len(kept) != len(text.splitlines()):
        HOSTS.write_text("\n".join(kept) + "\n")


def exec_prefix(node: Node, local_dir: Path) -> list[str]:
    """The command prefix that runs a program on `node`: its network namespace, its own hostname, and a
    node-local disk at `local_dir` (a tmpfs only this node sees, like a real node's local scratch).

    nsenter rather than `ip netns exec`, which also remounts /sys (slurmd then finds no cgroup file system).
    """
    return ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", f'hostname {node.name} && mount -t tmpfs -o size=256m tmpfs {local_dir} && exec "$@"', "sh"]
