"""Simulated hosts: one Linux network namespace per node, capped links between them.

Each node gets its own network namespace with one interface and its own
address (10.213.0.1, 10.213.0.2, ...). The interfaces are veth pairs whose
other ends sit on one bridge in the root namespace, so every node reaches
every other through its own link. ``tc qdisc ... tbf`` caps each link in both
directions (the node's upload on its side, its download on the bridge side).
``delay_ms`` adds a one-way delay per packet: the kernel here has no netem
(nor fq), so a user-space relay takes the bridge's place and holds every
frame ``delay_ms`` before passing it on (``dtlab.launch.netdelay``).

Needs root (CAP_NET_ADMIN) and iproute2. Everything is removed on exit, also
after an error or an interrupt; if the process that made them dies without a
word (SIGKILL), the reaper it registered them with removes them
(``dtlab.launch.lifeline``); and names carry the creating process id, so a
later run (or ``python -m dtlab clean``) removes whatever is left of a dead one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dtlab.launch import lifeline

__all__ = ["PREFIX", "Host", "NetnsError", "SimulatedHosts", "available", "leftovers", "remove_stale"]

PREFIX = "dtlab-"  # namespace names: dtlab-<pid>-<token>-<node>
_NS = re.compile(r"^dtlab-(\d+)-([0-9a-f]{6})-(\d+)$")
_SUBNET = "10.213.0"
# Namespaces are the machine's, and so is this lock: not under TMPDIR, which may differ from one user to the next.
_LOCK = Path("/tmp/dtlab-netns.lock")


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made."""


@dataclass(frozen=True)
class Host:
    """One simulated host: run its processes with ``ip netns exec <netns> ...``."""

    netns: str
    addr: str
    ifname: str  # the interface inside the namespace (GLOO_SOCKET_IFNAME)


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def available() -> tuple[bool, str]:
    """(True, "") where namespaces can be made here, else (False, the reason in one line)."""
    if os.geteuid() != 0:
        return False, "simulated hosts need root (network namespaces): falling back to loopback nodes"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"simulated hosts need iproute2 ({' and '.join(missing)} not found): falling back to loopback"
    probe = f"{PREFIX}{os.getpid()}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return False, f"cannot create a network namespace ({proc.stderr.strip()}): falling back to loopback nodes"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(netns: str) -> None:
    lifeline.remove_namespace(netns)  # its veth goes with it, and so the peer on the bridge


def _bridges() -> list[str]:
    out = _ip("-o", "link", "show", "type", "bridge", check=False)
    return [m[1] for m in re.finditer(r"^\d+:\s+(dtb[0-9a-f]{6})[:@]", out, re.M)]


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    # Making hosts and sweeping stale ones are serialised across processes: a sweep that ran between
    # another run's bridge and its first namespace would take the new bridge for a dead one.
    with open(_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale() -> list[str]:
    """Remove namespaces and bridges left by dtlab processes that no longer run; returns their names."""
    with _lock():
        return _remove_stale()


def _remove_stale() -> list[str]:
    removed = []
    live_tokens = set()
    for name in _namespaces():
        m = _NS.match(name)
        if not m:
            if name.startswith(PREFIX) and name.endswith("-probe") and not _alive(int(name.split("-")[1])):
                _delete_namespace(name)
                removed.append(name)
            continue
        if _alive(int(m[1])) and int(m[1]) != os.getpid():
            live_tokens.add(m[2])
            continue
        if int(m[1]) == os.getpid():  # ours, from a SimulatedHosts still open in this process
            live_tokens.add(m[2])
            continue
        _delete_namespace(name)
        removed.append(name)
    for bridge in _bridges():
        if bridge[3:] not in live_tokens:
            _ip("link", "del", bridge, check=False)
            removed.append(bridge)
    return removed


def leftovers(token: str | None = None) -> list[str]:
    """dtlab namespaces and bridges that exist now (those of ``token`` only, if given)."""
    names = [n for n in _namespaces() if n.startswith(PREFIX)] + _bridges()
    return [n for n in names if token is None or token in n]


def _burst_bytes(mbit: float) -> int:
    # tbf needs at least one timer tick's worth of tokens (rate / HZ); 4 ms at the rate, 64 KiB at least.
    return max(64 * 1024, int(mbit * 1e6 / 8 * 0.004))


class SimulatedHosts:
    """``with SimulatedHosts(2, link_mbit=200) as hosts:`` -> a list of ``Host``.

    ``link_mbit=None`` leaves the links uncapped (veth speed, several Gbit/s).
    ``delay_ms`` (> 0) delays every packet one way by that much (0: no delay).
    """

    def __init__(self, nodes: int, link_mbit: float | None = None, delay_ms: float = 0.0) -> None:
        if not isinstance(nodes, int) or not 1 <= nodes <= 250:
            raise ValueError(f"nodes={nodes!r} is invalid: must be an integer from 1 to 250")
        if link_mbit is not None and not link_mbit > 0:
            raise ValueError(f"link_mbit={link_mbit!r} is invalid: must be > 0 Mbit/s (or None: uncapped)")
        if not 0 <= delay_ms <= 1000:
            raise ValueError(f"delay_ms={delay_ms!r} is invalid: must be from 0 to 1000 ms")
        self.nodes, self.link_mbit, self.delay_ms = nodes, link_mbit, float(delay_ms)
        self._relay: subprocess.Popen | None = None
        self.token = secrets.token_hex(3)
        self.bridge = f"dtb{self.token}"
        self.hosts: list[Host] = []

    def __enter__(self) -> list[Host]:
        ok, reason = available()
        if not ok:
            raise NetnsError(reason)
        try:
            with _lock():
                _remove_stale()
                self._create()
        except BaseException:
            self.close()
            raise
        return self.hosts

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        if not self.delay_ms:  # with a delay, the relay joins the links instead
            lifeline.watch("link", self.bridge)  # registered first: a kill right after the add still finds it
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
        for i in range(self.nodes):
            netns = f"{PREFIX}{os.getpid()}-{self.token}-{i}"
            outside, inside = f"dtv{self.token}{i}", f"dtn{self.token}{i}"
            lifeline.watch("netns", netns)
            _ip("netns", "add", netns)
            self.hosts.append(Host(netns, f"{_SUBNET}.{i + 1}", inside))
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", netns)
            if self.delay_ms:
                _ip("link", "set", outside, "up")
            else:
                _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("-n", netns, "addr", "add", f"{_SUBNET}.{i + 1}/24", "dev", inside)
            _ip("-n", netns, "link", "set", inside, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            if self.link_mbit is not None:
                self._cap(netns, inside)
                self._cap(None, outside)
        if self.delay_ms:
            self._start_relay([f"dtv{self.token}{i}" for i in range(self.nodes)])

    def _start_relay(self, outsides: list[str]) -> None:
        cmd = [sys.executable, "-m", "dtlab.launch.netdelay", "--delay-ms", f"{self.delay_ms:g}", *outsides]
        self._relay = subprocess.Popen(lifeline.dying_with_parent(cmd), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
        line = self._relay.stdout.readline() if self._relay.stdout else ""
        if line.strip() != "ready":
            err = self._relay.stderr.read() if self._relay.stderr and self._relay.poll() is not None else ""
            raise NetnsError(f"the delay relay did not start: {err.strip() or line.strip() or 'no output'}")

    def _cap(self, netns: str | None, dev: str) -> None:
        tc = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.link_mbit:g}mbit",
              "burst", str(_burst_bytes(self.link_mbit)), "latency", "100ms"]
        cmd = ["ip", "netns", "exec", netns, *tc] if netns else tc
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NetnsError(f"`{' '.join(tc)}` failed: {proc.stderr.strip()}")

    def close(self) -> None:
        """Remove every namespace (killing what still runs inside) and the bridge. Safe to call twice."""
        if self._relay is not None:
            self._relay.kill()
            self._relay.wait()
            self._relay = None
        for host in self.hosts:
            _delete_namespace(host.netns)
        for i in range(self.nodes):  # also those made before a failure recorded them
            name = f"{PREFIX}{os.getpid()}-{self.token}-{i}"
            if name in _namespaces():
                _delete_namespace(name)
            lifeline.forget("netns", name)
        _ip("link", "del", self.bridge, check=False)
        lifeline.forget("link", self.bridge)
        self.hosts = []

    @staticmethod
    def command(host: Host, cmd: list[str]) -> list[str]:
        """``cmd`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.netns, *cmd]
