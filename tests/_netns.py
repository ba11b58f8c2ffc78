"""Separate network namespaces for tests/test_netns.py: three "hosts" joined by a bridge.

Topology (every name carries one random suffix, so concurrent runs never collide)::

    abw-XXXX (writer)  eth0 10.231.0.1/24 --veth-- pw ┐
    abr-XXXX (relay)   eth0 10.231.0.2/24 --veth-- pr ├ br0 in abb-XXXX (the "switch")
    abx-XXXX (reader)  eth0 10.231.0.3/24 --veth-- px ┘

Every link is created with ``ip -n NS`` inside the namespaces this module creates, so the host's
own network namespace is never touched: no interface, address or route appears there. Only
addresses from 10.231.0.0/24 are used. ``destroy`` deletes the four namespaces, which deletes
their veth pairs and the bridge with them.

A process joins a namespace with ``enter(name)`` (``setns(2)`` on ``/run/netns/NAME``), first
thing in a freshly spawned child, before it opens any socket. The parent (pytest) never moves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

SUBNET = "10.231.0"
WRITER_IP = f"{SUBNET}.1"
RELAY_IP = f"{SUBNET}.2"
READER_IP = f"{SUBNET}.3"
CLONE_NEWNET = 0x40000000


class Unavailable(Exception):
    """Namespaces cannot be created here; the message is the precise reason (for pytest.skip)."""


@dataclass
class Topology:
    suffix: str
    created: list[str] = field(default_factory=list)

    @property
    def writer_ns(self) -> str:
        return f"abw-{self.suffix}"

    @property
    def relay_ns(self) -> str:
        return f"abr-{self.suffix}"

    @property
    def reader_ns(self) -> str:
        return f"abx-{self.suffix}"

    @property
    def bridge_ns(self) -> str:
        return f"abb-{self.suffix}"

    def set_reader_link(self, up: bool) -> None:
        """Cut (or restore) the reader host's cable: its port on the bridge goes down (or up).
        The reader keeps its address and routes, as when a switch port or cable fails."""
        _ip("-n", self.bridge_ns, "link", "set", "px", "up" if up else "down")


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def check_available() -> None:
    """Raise ``Unavailable`` with the precise reason if namespaces cannot be created here."""
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"network namespaces need Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        raise Unavailable(f"creating network namespaces needs root (euid is {os.geteuid()})")
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` command (iproute2) is not installed")
    if _libc_setns() is None and not hasattr(os, "setns"):
        raise Unavailable("no setns(2): neither os.setns nor libc's setns is available")


def create() -> Topology:
    """Build the topology. Raises ``Unavailable`` (with the reason) when namespaces cannot be
    created; on any later failure, deletes what it made and re-raises."""
    check_available()
    topo = Topology(suffix=secrets.token_hex(3))
    probe = subprocess.run(
        ["ip", "netns", "add", topo.bridge_ns], capture_output=True, text=True, check=False, timeout=30
    )
    if probe.returncode != 0:
        raise Unavailable(f"`ip netns add {topo.bridge_ns}` failed: {probe.stderr.strip() or probe.returncode}")
    topo.created.append(topo.bridge_ns)
    try:
        b = topo.bridge_ns
        _ip("-n", b, "link", "set", "lo", "up")
        _ip("-n", b, "link", "add", "br0", "type", "bridge")
        _ip("-n", b, "link", "set", "br0", "up")
        for ns, port, ip in (
            (topo.writer_ns, "pw", WRITER_IP),
            (topo.relay_ns, "pr", RELAY_IP),
            (topo.reader_ns, "px", READER_IP),
        ):
            _ip("netns", "add", ns)
            topo.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Created in the bridge's namespace, the other end moved straight into the host's.
            _ip("-n", b, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", b, "link", "set", port, "master", "br0")
            _ip("-n", b, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
    except BaseException:
        destroy(topo)
        raise
    return topo


def destroy(topo: Topology) -> None:
    """Delete every namespace this topology created (their veths and the bridge go with them)."""
    errors = []
    for ns in reversed(topo.created):
        proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, check=False, timeout=30)
        if proc.returncode != 0:
            errors.append(f"{ns}: {proc.stderr.strip()}")
    topo.created.clear()
    if errors:
        raise RuntimeError("could not delete network namespaces: " + "; ".join(errors))


def exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def _libc_setns() -> Callable[[int, int], int] | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(path, use_errno=True), "setns", None)
    return cast("Callable[[int, int], int] | None", fn)


def enter(name: str) -> None:
    """Move the calling process (its only thread, in a fresh child) into network namespace
    ``name``. Threads started afterwards (ZeroMQ's, the library's) inherit it."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns = getattr(os, "setns", None)
        if setns is not None:  # Python 3.12+
            setns(fd, CLONE_NEWNET)
            return
        fn = _libc_setns()
        if fn is None:
            raise OSError("setns(2) is not available")
        if fn(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)
