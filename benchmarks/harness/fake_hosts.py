"""Hosts on one machine: network namespaces joined by veth pairs.

`fake_hosts(count, tag)` makes `count` namespaces ("hosts"), each with its
own loopback and one veth (`veth0`, address 10.213.0.<i+1>/24). Two hosts
are joined by their veth pair directly; more are joined through a bridge in
a namespace of its own. `rate_gbit` shapes what each host sends on its veth
(tc tbf; this kernel may lack netem, so no delay is added). `cut(host)`
makes a host's link silent (every packet it sends or is sent dropped, no
reset, no carrier change), `restore(host)` brings it back. Everything it
made, and any process left in its namespaces, is removed on exit, and
namespaces of earlier runs whose process died are removed on entry.

A process joins a host with `enter(host)` (setns) before it opens any socket;
`link_bytes(interface)` reads the bytes the calling process's namespace sent
and received on an interface (/proc/net/dev is per namespace). Needs root:
`cannot_make_namespaces()` says why not, or None.
"""

import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess
from typing import Iterator, List, Optional, Tuple

PREFIX = "ddpx"
SUBNET = "10.213.0"
VETH = "veth0"  # a host's interface, in its namespace
CLONE_NEWNET = 0x40000000


@dataclasses.dataclass(frozen=True)
class Host:
    netns: str
    veth: str
    addr: str


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def ip_in(netns: str, *args: str) -> str:
    """`ip args` inside `netns` (`ip -n` mis-parses some `link add` forms)."""
    return ip("netns", "exec", netns, "ip", *args)


def cannot_make_namespaces() -> Optional[str]:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (`ip netns add`)"
    try:
        subprocess.run(["ip", "-V"], check=True, capture_output=True, timeout=30)
        subprocess.run(["tc", "-V"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"needs the `ip` and `tc` tools (iproute2): {e}"
    return None


def remove_namespace(netns: str) -> None:
    """Kills what still runs in `netns`, then deletes it (and so its veths)."""
    try:
        pids = [int(p) for p in ip("netns", "pids", netns).split()]
    except subprocess.CalledProcessError:
        return  # never created
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


def remove_stale_namespaces(prefix: str = PREFIX) -> None:
    """Namespaces named <prefix><pid>_... whose process <pid> is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(prefix):].split("_")[0]
        if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            remove_namespace(name)


def _shape(netns: str, interface: str, rate_gbit: float) -> None:
    # burst: what passes at line speed; it must hold a rate's worth of a
    # kernel tick (4 ms at 250 Hz) for tbf to reach the rate.
    burst_kb = max(256, int(rate_gbit * 1e9 / 8 * 0.004 / 1024))
    subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", interface, "root", "tbf",
                    "rate", f"{rate_gbit}gbit", "burst", f"{burst_kb}kb", "latency", "50ms"],
                   check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def fake_hosts(count: int, tag: str, rate_gbit: Optional[float] = None) -> Iterator[List[Host]]:
    """`count` hosts (see the module's docstring), named <PREFIX><pid>_<tag>_*.
    Raises OSError / subprocess errors if they cannot be made."""
    base = f"{PREFIX}{os.getpid()}_{tag}"
    hosts = [Host(f"{base}_h{i}", VETH, f"{SUBNET}.{i + 1}") for i in range(count)]
    bridge = f"{base}_br" if count > 2 else None
    made = []
    try:
        remove_stale_namespaces()
        for name in [h.netns for h in hosts] + ([bridge] if bridge else []):
            ip("netns", "add", name)
            made.append(name)
            ip_in(name, "link", "set", "lo", "up")
        if count == 2:
            # Made inside host 0, one end then moved to host 1.
            ip_in(hosts[0].netns, "link", "add", VETH, "type", "veth", "peer", "name", "peer0")
            ip_in(hosts[0].netns, "link", "set", "peer0", "netns", hosts[1].netns)
            ip_in(hosts[1].netns, "link", "set", "peer0", "name", VETH)
        elif count > 2:
            ip_in(bridge, "link", "add", "br0", "type", "bridge")
            ip_in(bridge, "link", "set", "br0", "up")
            for i, h in enumerate(hosts):
                ip_in(bridge, "link", "add", f"port{i}", "type", "veth", "peer", "name", f"host{i}")
                ip_in(bridge, "link", "set", f"port{i}", "master", "br0")
                ip_in(bridge, "link", "set", f"port{i}", "up")
                ip_in(bridge, "link", "set", f"host{i}", "netns", h.netns)
                ip_in(h.netns, "link", "set", f"host{i}", "name", VETH)
        else:
            # One host: a veth whose peer stays inside (nothing crosses it).
            ip_in(hosts[0].netns, "link", "add", VETH, "type", "veth", "peer", "name", "peer0")
            ip_in(hosts[0].netns, "link", "set", "peer0", "up")
        for h in hosts:
            ip_in(h.netns, "addr", "add", f"{h.addr}/24", "dev", h.veth)
            ip_in(h.netns, "link", "set", h.veth, "up")
            if rate_gbit is not None and count > 1:
                _shape(h.netns, h.veth, rate_gbit)
        yield hosts
    finally:
        for name in made:
            remove_namespace(name)


def cut(host: Host, others=()) -> None:
    """Silently drops every packet on `host`'s link: what it sends (a
    blackhole qdisc on its veth) and, through `others` (the hosts at the
    other end), what is sent to it. Nothing is reset and the carrier stays
    up, as when a cable or a switch in the middle fails."""
    for h in [host, *others]:
        subprocess.run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", h.veth, "root",
                        "blackhole"], check=True, capture_output=True, timeout=30)


def restore(host: Host, others=()) -> None:
    """Undoes `cut` (and any shaping of these links)."""
    for h in [host, *others]:
        subprocess.run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "del", "dev", h.veth, "root"],
                       capture_output=True, timeout=30)


def enter(host: Host) -> None:
    """Moves the calling process (its calling thread: call it before any
    other thread starts) into `host`'s network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{host.netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {host.netns} failed")
    finally:
        os.close(fd)


def enter_rank(placed: List[Host], ranks_per_host: int, rank: int, torchrun: bool = False) -> Host:
    """Runs first in the process of rank `rank` (ranks numbered host by
    host, `ranks_per_host` on each of `placed`): into its host, with Gloo on
    the host's link, and with `torchrun` the variables torchrun sets
    (LOCAL_WORLD_SIZE, LOCAL_RANK), which tell ddp_ext the hosts. Returns the host."""
    host = placed[rank // ranks_per_host]
    enter(host)
    os.environ["GLOO_SOCKET_IFNAME"] = host.veth
    if torchrun:
        os.environ.update(LOCAL_WORLD_SIZE=str(ranks_per_host), LOCAL_RANK=str(rank % ranks_per_host))
    return host


def link_bytes(interface: str = VETH) -> Tuple[int, int]:
    """(received, sent) bytes on `interface` of the caller's namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == interface:
                values = fields.split()
                return int(values[0]), int(values[8])
    raise ValueError(f"no interface {interface} in this network namespace")
