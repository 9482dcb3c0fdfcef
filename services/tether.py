"""`python -m services.tether --parent PID [--pdeathsig] [--grace S] MODULE ARGS...`: run a
service module (as `python -m MODULE ARGS` would) that ends when the process that started it dies.

The launcher starts every service through this, so a launcher that dies, however it dies (SIGKILL
included), leaves no service behind holding the stack's ports. Two mechanisms:

- `--pdeathsig` (Linux): the kernel sends SIGTERM when the parent goes (prctl PR_SET_PDEATHSIG).
  The kernel ties it to the parent *thread* that forked, so the launcher asks for it only from its
  main thread;
- a watchdog thread (every platform): polls `os.getppid()`; once the parent is gone it sends the
  process SIGTERM, so the service drains as on any stop, and ends it after `--grace` seconds if
  the drain has not.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.util
import logging
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Sequence

log = logging.getLogger("services.tether")

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def set_parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> bool:
    """Ask the kernel for `sig` when the parent dies; False where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    print(f"tether: parent process {parent} is gone; stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"tether: still running {grace_s:g} s after the parent died; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def tether(parent: int, *, pdeathsig: bool, grace_s: float) -> None:
    """Arm both mechanisms for `parent`; exits at once when it is already gone."""
    if pdeathsig:
        set_parent_death_signal(signal.SIGTERM)
    # The parent may have died before prctl ran: then nobody will send the signal.
    if os.getppid() != parent:
        print(f"tether: parent process {parent} died before the start", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent, grace_s), name="tether", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.tether", description=__doc__.split("\n\n")[0])
    p.add_argument("--parent", type=int, required=True, help="the pid whose death ends the service")
    p.add_argument("--pdeathsig", action="store_true", help="also ask the kernel (Linux) for SIGTERM")
    p.add_argument("--grace", type=float, default=15.0, help="seconds to drain before a hard exit")
    p.add_argument("module")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    if importlib.util.find_spec(ns.module) is None:
        # What `python -m` says, so a wrong module reads the same in the log.
        print(f"{sys.executable}: No module named {ns.module}", file=sys.stderr)
        sys.exit(1)
    tether(ns.parent, pdeathsig=ns.pdeathsig, grace_s=ns.grace)
    sys.argv = [ns.module, *ns.args]
    runpy.run_module(ns.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
