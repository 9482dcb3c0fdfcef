"""Free TCP ports for stacks side by side and for parallel test workers, and which ports a listener
already holds."""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICKED_PORT = 20000
_MAX_PORT_SLICES = 16  # workers of a parallel test run whose count is not known
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _worker_slice(candidates: range, env) -> range:
    """The part of `candidates` that belongs to this pytest-xdist worker (`PYTEST_XDIST_WORKER`
    gwN of `PYTEST_XDIST_WORKER_COUNT`), so that two workers' stacks, which draw ports in separate
    processes, never pick the same one; all of it outside a parallel test run. The services a
    worker starts inherit its environment and so draw from its slice too."""
    worker = env.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return candidates
    try:
        count = max(int(env.get("PYTEST_XDIST_WORKER_COUNT", "")), 1)
    except ValueError:
        count = _MAX_PORT_SLICES
    index = int(worker[2:])
    count = max(count, index + 1)
    size = len(candidates) // count
    if size < 100:
        raise RuntimeError(f"{len(candidates)} ports cannot be split among {count} test workers")
    start = candidates.start + index * size
    return range(start, start + size)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now that this process has not handed out before (tests, stacks side by side).

    It is drawn outside the kernel's ephemeral range, so the outgoing connections of the processes
    around (a gRPC channel, a Redis client) cannot take it between this call and the service's bind,
    and it is never the same as an earlier answer, so two services of one stack never share a port.
    Under pytest-xdist each worker draws from a slice of its own (`_worker_slice`).
    """
    low, high = _ephemeral_range()
    if low - _LOWEST_PICKED_PORT >= 1000:
        candidates = range(_LOWEST_PICKED_PORT, low)
    elif 65535 - high >= 1000:
        candidates = range(high + 1, 65536)
    else:
        candidates = range(1024, 65536)
    candidates = _worker_slice(candidates, os.environ)
    rng = random.Random()
    with _handed_out_lock:
        for _ in range(1000):
            port = rng.choice(candidates)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free TCP port found on {host} in {candidates.start}-{candidates.stop - 1}")


def ports_in_use(host: str, ports: dict[str, int]) -> dict[str, int]:
    """The entries of `ports` (name -> port, 0 = none) that a listener holds on `host` now."""
    taken = {}
    for name, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR as the servers bind: a port whose last connections linger in TIME_WAIT
            # is free for them, only a listener is in the way.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                taken[name] = port
    return taken
