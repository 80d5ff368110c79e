"""Where dtlab's servers listen: loopback unless the user asks otherwise.

TensorPipe (RPC) binds by interface name, so an address is turned into the
interface that owns it; any address but loopback draws a warning, since RPC
unpickles whatever reaches its socket without authentication.
"""

from __future__ import annotations

import warnings

LOOPBACK = "127.0.0.1"


def interface_for(address: str) -> str:
    """The network interface that owns ``address`` (TensorPipe binds by interface name)."""
    import socket

    import psutil

    found = {name: [a.address for a in addrs if a.family == socket.AF_INET]
             for name, addrs in psutil.net_if_addrs().items()}
    for name, addrs in found.items():
        if address in addrs:
            return name
    known = ", ".join(f"{n}={'/'.join(a)}" for n, a in found.items() if a)
    raise ValueError(f"bind_address={address!r} is not an IPv4 address of this machine ({known})")


def warn_if_exposed(address: str) -> None:
    if address != LOOPBACK:
        warnings.warn(f"RPC will listen on {address}, reachable from other machines: torch.distributed.rpc "
                      "deserialises (unpickles) every message it receives without authentication, so anyone "
                      "who can connect can run code in these processes. Use it only on a trusted network.",
                      UserWarning, stacklevel=3)


def listening_sockets() -> list[str]:
    """``address:port`` of every socket this process listens on (TCP)."""
    import psutil

    return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN)
