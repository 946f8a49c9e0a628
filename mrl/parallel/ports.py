"""Free TCP ports for rendezvous: without torch, so that a process that only places or probes (a Ray worker host
before its work is known) does not import it to find one."""

from __future__ import annotations

import random
import socket

#: Where `free_port` looks: above Ray's worker ports (10002-19999 by default) and below the OS's ephemeral range.
PICKED_PORTS = (20000, 32768)
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ports_to_pick_from() -> range:
    """PICKED_PORTS, cut at the start of this machine's ephemeral range (empty where that starts too low)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            ephemeral_start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_start = PICKED_PORTS[1]
    return range(PICKED_PORTS[0], min(PICKED_PORTS[1], ephemeral_start))


def _bind(sock: socket.socket, host: str, port: int) -> int:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return int(sock.getsockname()[1])


def free_port(host: str = "") -> int:
    """A TCP port that is free on this machine right now, picked at random below the OS's ephemeral range.

    Hazard: the port is released before the rendezvous binds it (seconds later: the ranks import first), so another
    socket may take it in between. Ports the OS hands out itself come from the ephemeral range: `bind(port 0)` and
    the local end of every outgoing connection (Ray's processes keep hundreds open). A port found by binding port 0
    was taken that way once (EADDRINUSE when rank 0's store bound it, two runs side by side under make test). Below
    that range only another pick like this one can take it: one in ~12,000 for two picks in the same seconds.
    Falls back to port 0 where the ephemeral range leaves nothing to pick from. It must run on the node of the
    rendezvous host, not on the driver.
    """
    candidates = _ports_to_pick_from()
    if len(candidates) >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    return _bind(sock, host, rng.choice(candidates))
                except OSError:
                    continue  # in use: pick again
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return _bind(sock, host, 0)
