"""A box's network: a namespace on a private bridge, with a link of its own that can be cut.

Every box gets a network namespace and a veth pair: one end (`eth0`) inside
with the box's address, the other on a bridge in the host namespace, which
also has an address there, so the rehearsal's own client reaches the broker.
A link rate is a token bucket (`tc tbf`) on both ends of the pair: the
machine this runs on may lack netem, and a rate is what a slow switch or
Wi-Fi link costs a stage. Setting the host end down is a pulled cable:
packets vanish, and no FIN or RST tells either side.

Names carry the run's id, so a rehearsal never meets a leftover of another.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

# Prefix length of the rehearsal subnet: room for 250 boxes.
PREFIX_LEN = 24
# Host address of the bridge in the subnet; boxes count up from FIRST_BOX_HOST.
BRIDGE_HOST = 1
FIRST_BOX_HOST = 10
# The subnet is picked at random in 10.64.0.0/10's /24s, away from the
# 10.0.x.0 and 10.1xx.x.0 ranges that Docker, VPNs and labs tend to use.
_SUBNET_POOL = ipaddress.IPv4Network("10.64.0.0/10")
_SUBNET_TRIES = 32
# Routes shorter than this are default routes (0/0, or a VPN's 0/1 and 128/1):
# they cover every subnet, and the bridge's more specific route wins over them.
MIN_ROUTE_PREFIX = 2
# Route types `ip route` writes before the destination.
_ROUTE_TYPES = ("unicast", "local", "broadcast", "multicast", "unreachable", "prohibit",
                "blackhole", "throw", "nat")
# The token bucket holds 10 ms at the link rate (and never less than 32 KiB):
# bursts the size of one activation frame pass at line rate, as on a switch
# port, while a long transfer is held to the rate.
BURST_S = 0.01
MIN_BURST_BYTES = 32 * 1024
# A packet waits at most this long in the bucket's queue before it is
# dropped: a switch port's buffer, not an unbounded one.
TBF_LATENCY_MS = 200
COMMAND_TIMEOUT_S = 30.0


class NetworkError(RuntimeError):
    """A step of building or changing the rehearsal network failed."""


def missing() -> list[str]:
    """What this machine lacks for namespaces, veth pairs and rate limits."""
    problems = []
    if os.geteuid() != 0:
        problems.append("root: network namespaces and veth pairs need CAP_NET_ADMIN — run as "
                        "root (sudo)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            problems.append(f"the `{tool}` command — install {package}")
    if not Path("/proc/self/ns/net").exists():
        problems.append("network namespaces: this kernel has no /proc/self/ns/net")
    return problems


def run(*args: str) -> str:
    """Run a command (ip, tc); its stderr becomes the error."""
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(f"`{' '.join(args)}` failed: {exc}") from None
    if result.returncode != 0:
        raise NetworkError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class BoxLink:
    """One box's place on the network."""

    box: str
    namespace: str
    address: str
    host_end: str  # the veth end on the bridge: down is a cut cable
    mbit: float | None

    def counters(self) -> tuple[int, int]:
        """(bytes to the box, bytes from the box) so far, as the host end of its link counts."""
        stats = Path("/sys/class/net") / self.host_end / "statistics"
        # The host end transmits what goes into the box and receives what leaves it.
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


class Network:
    """The rehearsal's bridge and its boxes; `remove` takes everything away again."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.bridge = f"eb{run_id}"
        self.subnet = _free_subnet()
        self.links: dict[str, BoxLink] = {}
        self._created_bridge = False

    @property
    def host_address(self) -> str:
        """The host namespace's address on the bridge: where the rehearsal's client sits."""
        return str(self.subnet[BRIDGE_HOST])

    def create(self) -> None:
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self._created_bridge = True
        run("ip", "addr", "add", f"{self.host_address}/{PREFIX_LEN}", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")

    def add_box(self, box: str, mbit: float | None) -> BoxLink:
        index = len(self.links)
        namespace = f"edgebus-{self.run_id}-{box}"
        host_end, box_end = f"eb{self.run_id}h{index}", f"eb{self.run_id}b{index}"
        link = BoxLink(box, namespace, str(self.subnet[FIRST_BOX_HOST + index]), host_end, mbit)
        run("ip", "netns", "add", namespace)
        self.links[box] = link
        run("ip", "link", "add", host_end, "type", "veth", "peer", "name", box_end)
        run("ip", "link", "set", box_end, "netns", namespace)
        run("ip", "link", "set", host_end, "master", self.bridge)
        run("ip", "link", "set", host_end, "up")
        inside = ("ip", "netns", "exec", namespace)
        run(*inside, "ip", "link", "set", box_end, "name", "eth0")
        run(*inside, "ip", "addr", "add", f"{link.address}/{PREFIX_LEN}", "dev", "eth0")
        run(*inside, "ip", "link", "set", "eth0", "up")
        run(*inside, "ip", "link", "set", "lo", "up")
        if mbit is not None:
            # Both directions: a box's uplink and downlink are each at the rate.
            self._limit((), host_end, mbit)
            self._limit(inside, "eth0", mbit)
        return link

    @staticmethod
    def _limit(prefix: tuple[str, ...], device: str, mbit: float | None) -> None:
        """Set (`replace`) the device's rate, or with None remove it."""
        if mbit is None:
            run(*prefix, "tc", "qdisc", "del", "dev", device, "root")
            return
        rate_bytes = mbit * 1e6 / 8
        burst = max(MIN_BURST_BYTES, int(rate_bytes * BURST_S))
        run(*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
            "rate", f"{mbit * 1000:.0f}kbit", "burst", str(burst),
            "latency", f"{TBF_LATENCY_MS}ms")

    def set_rate(self, box: str, mbit: float | None) -> None:
        """Change `box`'s link rate while it runs (None: unlimited), as a move to another
        switch port would."""
        link = self.links[box]
        if mbit is None and link.mbit is None:
            return  # no qdisc of ours to remove
        self._limit((), link.host_end, mbit)
        self._limit(("ip", "netns", "exec", link.namespace), "eth0", mbit)
        self.links[box] = replace(link, mbit=mbit)

    def set_link(self, box: str, up: bool) -> None:
        """Plug (`up`) or pull the cable of `box`."""
        run("ip", "link", "set", self.links[box].host_end, "up" if up else "down")

    def remove(self) -> None:
        """Delete every namespace (which deletes its veth pair) and the bridge; best effort."""
        errors = []
        for link in self.links.values():
            try:
                run("ip", "netns", "del", link.namespace)
            except NetworkError as exc:
                errors.append(str(exc))
        self.links.clear()
        if self._created_bridge:
            try:
                run("ip", "link", "del", self.bridge)
            except NetworkError as exc:
                errors.append(str(exc))
            self._created_bridge = False
        if errors:
            raise NetworkError("; ".join(errors))


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in the pool that no route of this machine covers or overlaps.

    A default route covers every address and is not counted (the bridge's own
    route is more specific and wins), nor are the halves of a default a VPN
    sets (0.0.0.0/1 and 128.0.0.0/1). Its gateway is counted: a default via
    an address in the subnet, reached `onlink` with no route of its own, would
    otherwise be cut off by the bridge. So is every address of this machine.
    """
    blocked = blocked_networks(run("ip", "-4", "route", "show", "table", "all"),
                               run("ip", "-4", "-o", "addr", "show"))
    candidates: list[ipaddress.IPv4Network] = list(_SUBNET_POOL.subnets(new_prefix=PREFIX_LEN))
    for _ in range(_SUBNET_TRIES):
        subnet = random.choice(candidates)
        if not any(subnet.overlaps(net) for net in blocked):
            return subnet
    raise NetworkError(f"found no free /{PREFIX_LEN} in {_SUBNET_POOL} after {_SUBNET_TRIES} "
                       "tries: the machine routes most of it — remove stale routes")


def blocked_networks(routes: str, addresses: str) -> list[ipaddress.IPv4Network]:
    """What a rehearsal subnet must not overlap, from `ip -4 route show table all` and
    `ip -4 -o addr show`: every route but the default ones, every route's gateway,
    every address of this machine."""
    blocked = []
    for line in routes.splitlines():
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]
        if not words:
            continue
        with contextlib.suppress(ValueError):  # "default" (0.0.0.0/0) and the like
            net = ipaddress.IPv4Network(words[0], strict=False)
            if net.prefixlen >= MIN_ROUTE_PREFIX:
                blocked.append(net)
        if "via" in words[:-1]:
            with contextlib.suppress(ValueError):
                blocked.append(ipaddress.IPv4Network(words[words.index("via") + 1]))
    for line in addresses.splitlines():  # "2: eth0    inet 192.0.2.2/24 brd ..."
        words = line.split()
        if len(words) > 3 and words[2] == "inet":
            blocked.append(ipaddress.IPv4Network(words[3], strict=False))
    return blocked
