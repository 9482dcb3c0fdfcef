"""The local launcher's supervision: a service of the stack that exits is started again.

A stage that dies (a crash, an out-of-memory kill, `kill -9`) used to take the whole `make run`
stack down. The supervisor starts it again with the same flags, after a back-off that doubles with
each restart (from `first_backoff_s` up to `max_backoff_s`), and gives up, stopping the stack, when
one service has needed more than `max_restarts` restarts within `window_s` (a service that cannot
start would otherwise be restarted forever). The other services ride the outage as they do in a
cluster: the talker and the gateway report NOT_SERVING while a stage they need is away (within a
second of its death: the talker sees a code2wav connection refused), and SERVING again once it is
back.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # per service within window_s; 0: never restart (a death stops the stack)
    window_s: float = 300.0
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.first_backoff_s < 0:
            raise ValueError("max_restarts must be >= 0, window_s > 0 and first_backoff_s >= 0")

    def backoff_s(self, recent_restarts: int) -> float:
        """The wait before a restart, with `recent_restarts` already made within the window."""
        return min(self.max_backoff_s, self.first_backoff_s * 2**recent_restarts)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor:
    """Watches `stack.processes`; `check()` once in a while (the launcher's loop) restarts the ones
    that exited when their back-off has passed. `stack` needs `processes` (each with `name`,
    `alive()`, `popen.returncode`, `log_tail()`) and `restart(name)`, which starts the service again
    and waits until it is SERVING (raising a RuntimeError, the launcher's StartupError, when it
    does not come up)."""

    def __init__(
        self,
        stack: Any,
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = _stderr,
    ):
        self.stack = stack
        self.policy = policy or RestartPolicy()
        self._clock = clock
        self._say = say
        self._restarts: dict[str, deque[float]] = {}
        self._due: dict[str, float] = {}  # service -> when its restart is due
        self.restarted: list[str] = []  # every restart made, in order

    def _recent(self, name: str, now: float) -> deque[float]:
        times = self._restarts.setdefault(name, deque())
        while times and now - times[0] > self.policy.window_s:
            times.popleft()
        return times

    def check(self) -> str | None:
        """Schedule a restart for each service found dead, run those that are due; the name of a
        service past its restart limit (the stack should stop), else None."""
        now = self._clock()
        for proc in list(self.stack.processes):
            if proc.alive() or proc.name in self._due:
                continue
            recent = self._recent(proc.name, now)
            if len(recent) >= self.policy.max_restarts:
                self._say(
                    f"{proc.name} exited with code {proc.popen.returncode} after {len(recent)} restarts "
                    f"in {self.policy.window_s:g} s; stopping the stack. Log tail:\n{proc.log_tail()}"
                )
                return proc.name
            wait = self.policy.backoff_s(len(recent))
            self._say(
                f"{proc.name} exited with code {proc.popen.returncode}; restarting it in {wait:.1f} s "
                f"(restart {len(recent) + 1} of at most {self.policy.max_restarts} in "
                f"{self.policy.window_s:g} s). Log tail:\n{proc.log_tail(10)}"
            )
            self._due[proc.name] = now + wait
        for name, due in sorted(self._due.items(), key=lambda item: item[1]):
            if due > self._clock():
                continue
            del self._due[name]
            self._recent(name, self._clock()).append(self._clock())
            try:
                self.stack.restart(name, grace=1.0)
            except RuntimeError as exc:  # StartupError: dead again: the next check schedules the next try
                self._say(f"{name} did not come back: {exc}")
                continue
            self.restarted.append(name)
            self._say(f"{name} is SERVING again")
        return None
