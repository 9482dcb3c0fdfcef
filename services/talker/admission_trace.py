"""A record of the talker's admission decisions over time, one JSON line each (`--admission-trace`).

The metrics give a run's distributions (the capacity, the room sent to the gateways); what a
closed loop's opening does in its first two seconds needs the sequence: which bound held the
queue at each plan, how fast the queue was predicted to drain against how fast it did, the room
each gateway was told. Off by default; an operator turns it on to see why a burst was refused.

Four kinds of line, each with `t` (seconds on the engine's clock since the trace began):

- `plan`: a plan that starts, refuses or steps: running and waiting streams after it, admitted
  and refused by it, the streams it steps and its prefill budget (prompt positions), the
  admission capacity and the costs it comes from, the queue's measured drain rate (a second),
  the tightest running stream's time left, and why admission holds ("" while it does not);
- `step`: a step that ran: its batch, the prompts it prefilled and their positions, its seconds;
- `room`: a room worked out for the gateways (`ahead`: prompts being built, not yet queued);
- `refuse`: a request refused at submission (queue full, or its predicted wait past its share of
  the first-audio budget), with the wait the forecast predicted for it.

The engine thread only appends a tuple to a deque; a daemon thread writes the lines every
`flush_s` (and at `close`), so the trace costs the step no I/O. Lines past `max_pending` between
two writes are dropped and counted (`dropped` in the next `gap` line), never blocking the engine.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PLAN_FIELDS = (
    "running", "waiting", "admitted", "refused", "stepping", "prefill_budget", "capacity",
    "step_base_s", "step_per_stream_s", "prefill_request_s", "prefill_position_s",
    "decoder_frame_s", "decoder_call_load", "drain_per_s", "tightest_s", "reason",
)  # fmt: skip
STEP_FIELDS = ("batch", "prompts", "prefill_positions", "seconds")
ROOM_FIELDS = ("ahead", "start_now", "accept", "running", "waiting")
REFUSE_FIELDS = ("ahead", "running", "waiting", "predicted_wait_s")
_FIELDS = {"plan": PLAN_FIELDS, "step": STEP_FIELDS, "room": ROOM_FIELDS, "refuse": REFUSE_FIELDS}


def _clean(value: Any) -> Any:
    """JSON has no infinity or NaN: those are written as null."""
    if isinstance(value, float):
        return round(value, 9) if math.isfinite(value) else None
    return value


class AdmissionTrace:
    """Appends from the engine thread (and the room's callers), writes from its own thread."""

    def __init__(
        self,
        path: str | Path,
        clock: Callable[[], float] = time.perf_counter,
        flush_s: float = 0.5,
        max_pending: int = 200_000,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._clock = clock
        self._t0 = clock()
        self._flush_s = flush_s
        self._max_pending = max_pending
        # deque: append (the engine's threads) and popleft (the writer) are each atomic, so a
        # line appended while a write runs waits for the next one instead of being lost.
        self._pending: deque[tuple] = deque()
        self._dropped = 0
        self._lock = threading.Lock()  # the writer's swap against `close`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write_loop, name="admission-trace", daemon=True)
        self._thread.start()

    def _add(self, kind: str, now: float | None, values: tuple) -> None:
        if len(self._pending) >= self._max_pending:
            self._dropped += 1
            return
        t = (self._clock() if now is None else now) - self._t0
        self._pending.append((kind, t, values))

    def plan(self, now: float | None = None, **fields: Any) -> None:
        self._add("plan", now, tuple(fields.get(k) for k in PLAN_FIELDS))

    def step(self, now: float | None = None, **fields: Any) -> None:
        self._add("step", now, tuple(fields.get(k) for k in STEP_FIELDS))

    def room(self, now: float | None = None, **fields: Any) -> None:
        self._add("room", now, tuple(fields.get(k) for k in ROOM_FIELDS))

    def refuse(self, now: float | None = None, **fields: Any) -> None:
        self._add("refuse", now, tuple(fields.get(k) for k in REFUSE_FIELDS))

    def _write_loop(self) -> None:
        while not self._stop.wait(self._flush_s):
            self.flush()

    def flush(self) -> None:
        """Write the lines appended so far."""
        with self._lock:
            if self._file.closed:
                return
            pending = [self._pending.popleft() for _ in range(len(self._pending))]
            dropped, self._dropped = self._dropped, 0
            lines = []
            if dropped:
                lines.append(json.dumps({"kind": "gap", "dropped": dropped}))
            for kind, t, values in pending:
                row = {"kind": kind, "t": round(t, 6)}
                row.update(zip(_FIELDS[kind], map(_clean, values), strict=True))
                lines.append(json.dumps(row))
            if lines:
                try:
                    self._file.write("\n".join(lines) + "\n")
                    self._file.flush()
                except OSError as exc:  # a full disk must not stop the talker
                    log.warning("admission trace %s: %d lines not written: %s", self.path, len(lines), exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.flush()
        with self._lock:
            self._file.close()


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a trace file (or its gzip, `.gz`), as dicts (for the benchmarks' reports and
    the tests)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
