"""An idle prober beside a level run over client processes (`--refusal-probe-s`).

A closed loop past capacity is a refusal storm: every refused worker sends again at once, so each
client process spends its loop on refusals, and a refusal's time as that process records it
includes the process's own queue (benchmarks/refusal_latency.py: 2-4 ms at the gateway, p50
100-150 ms in a loaded client process on the same run). While the level runs in its worker
processes, the parent's loop is idle: it sends one short request (one frame) at a time, every
`every_s`, and times it alone. Its refusals' latency is the server's answer without a loaded
client in it; a probe let in costs the stack one frame.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from benchmarks.metrics import REFUSAL_STATUSES, percentiles
from benchmarks.transport import Synthesizer

PROBE_TEXT = "A probe."


async def probe_until(
    synthesizer: Synthesizer, level: asyncio.Future, *, every_s: float, first_index: int
) -> dict[str, Any]:
    """Probe until `level` is done; what the probes saw (statuses, refusal latency percentiles)."""
    statuses: Counter[str] = Counter()
    refused: list[float] = []
    index = first_index
    while not level.done():
        record = await synthesizer.synthesize(index, 0, PROBE_TEXT, max_new_tokens=1)
        index += 1
        statuses[record.status] += 1
        if record.status in REFUSAL_STATUSES and record.e2e_s is not None:
            refused.append(record.e2e_s)
        await asyncio.wait([level], timeout=every_s)
    return {
        "every_s": every_s,
        "sent": index - first_index,
        "statuses": dict(statuses),
        "refusal_latency_s": percentiles(refused),
    }
