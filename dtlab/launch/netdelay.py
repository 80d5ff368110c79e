"""A fixed one-way delay on every packet between simulated hosts, where the kernel has no ``netem``.

``SimulatedHosts(..., delay_ms=d)`` starts this relay in place of the bridge:
``python -m dtlab.launch.netdelay --delay-ms d IF...`` with the root-namespace
ends of the hosts' links. It reads every frame a host sends (a packet socket
per link, with the kernel's offload header so that segmentation-offloaded TCP
frames travel whole and keep their checksum state), holds it ``d`` ms from
its arrival, then writes it to the link of the host it is for (learned from
source addresses; broadcasts to all). Frames stay in order per link, and a
frame's wait overlaps the next ones', as on a real link with latency: the
delay adds once per message, not per packet. The links' ``tbf`` caps stay
where they are, so bandwidth and latency add up.

It exits when a link disappears (the hosts were removed) or on SIGTERM.
"""

from __future__ import annotations

import argparse
import errno
import queue
import socket
import sys
import threading
import time

__all__ = ["relay"]

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15  # frames carry a virtio_net_hdr: GSO and checksum state pass through unchanged
PACKET_OUTGOING = 4
VNET_HDR_BYTES = 10
FRAME_MAX = 1 << 18


def _open(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((ifname, ETH_P_ALL))
    return sock


def _receive(port: int, sock: socket.socket, delay_s: float, held: queue.SimpleQueue) -> None:
    while True:
        data, addr = sock.recvfrom(FRAME_MAX)
        if addr[2] != PACKET_OUTGOING:  # skip the frames this relay itself wrote to the link
            held.put((time.monotonic() + delay_s, port, data))


def _deliver(socks: list[socket.socket], held: queue.SimpleQueue, macs: dict[bytes, int]) -> None:
    while True:
        due, port, data = held.get()
        frame = data[VNET_HDR_BYTES:]
        macs[frame[6:12]] = port
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        dest = macs.get(frame[0:6])
        for i in ([dest] if dest is not None and dest != port else range(len(socks))):
            if i != port:
                try:
                    socks[i].send(data)
                except OSError as exc:  # the link's queue is full: the frame is dropped, as a router would
                    if exc.errno not in (errno.ENOBUFS, errno.EAGAIN):
                        raise


def relay(ifnames: list[str], delay_ms: float) -> None:
    """Forward frames between the ``ifnames`` links, each ``delay_ms`` after it arrived; returns on a link's loss."""
    socks = [_open(name) for name in ifnames]
    macs: dict[bytes, int] = {}
    failed = threading.Event()

    def guard(fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except OSError as exc:  # a link is gone (the hosts were removed), or it cannot send: stop, and say why
            print(f"netdelay: {exc}", file=sys.stderr, flush=True)
            failed.set()

    for port, sock in enumerate(socks):
        held: queue.SimpleQueue = queue.SimpleQueue()  # one FIFO per link: constant delay keeps it in order
        threading.Thread(target=guard, args=(_receive, port, sock, delay_ms / 1e3, held), daemon=True).start()
        threading.Thread(target=guard, args=(_deliver, socks, held, macs), daemon=True).start()
    print("ready", flush=True)
    failed.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("ifnames", nargs="+")
    args = p.parse_args(argv)
    if not args.delay_ms > 0:
        p.error(f"--delay-ms={args.delay_ms!r} is invalid: must be > 0")
    relay(args.ifnames, args.delay_ms)
    sys.exit(0)


if __name__ == "__main__":
    main()
