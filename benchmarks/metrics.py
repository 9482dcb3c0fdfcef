"""Pure calculations over recorded audio streams: underrun, first audible sample, percentiles.

Definitions follow DESIGN.md section 5 (and vLLM-Omni's benchmark) so numbers compare with the field:
TTFA is request sent -> first non-empty audio byte; RTF is end-to-end time / audio duration; the
underrun model plays the stream from the moment its first chunk has fully arrived, with no pre-roll,
at 48000 bytes/s (24 kHz s16le mono), and never pauses.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SAMPLE_RATE_HZ = 24000
BYTES_PER_SAMPLE = 2
PCM_BYTES_PER_SECOND = SAMPLE_RATE_HZ * BYTES_PER_SAMPLE
PERCENTILES = (50, 90, 95, 99)
DEFAULT_AUDIBLE_DBFS = -50.0
# A chunk arriving exactly on time must not show up as a 1e-17 s underrun from float rounding.
_ROUNDING_BYTES = 1e-6


def max_underrun_s(
    chunk_times_s: Sequence[float],
    chunk_bytes: Sequence[int],
    bytes_per_second: float = PCM_BYTES_PER_SECOND,
) -> float:
    """The largest playback deficit of a stream, in seconds (0.0 when it never starves).

    `chunk_times_s[i]` is when chunk i had fully arrived (any common origin) and `chunk_bytes[i]` its
    size. For every chunk after the first: deficit = (t_i - t_0) * rate - bytes received before
    chunk i; a positive deficit is an underrun of deficit / rate seconds. Empty chunks carry no
    audio and are skipped.
    """
    if len(chunk_times_s) != len(chunk_bytes):
        raise ValueError("chunk_times_s and chunk_bytes differ in length")
    arrivals = [(t, n) for t, n in zip(chunk_times_s, chunk_bytes, strict=True) if n > 0]
    if not arrivals:
        return 0.0
    t0 = arrivals[0][0]
    received = 0
    worst = 0.0
    for i, (t, n) in enumerate(arrivals):
        if i > 0:
            deficit = (t - t0) * bytes_per_second - received
            if deficit > _ROUNDING_BYTES:
                worst = max(worst, deficit / bytes_per_second)
        received += n
    return worst


def dbfs_to_s16_amplitude(dbfs: float) -> float:
    """The s16 sample magnitude of a level in dBFS (0 dBFS = full scale 32768)."""
    return 32768.0 * 10.0 ** (dbfs / 20.0)


class AudibleDetector:
    """Finds the first s16le sample at or above a level, fed chunk by chunk.

    Transport reads may split a sample across two chunks, so an odd trailing byte is carried over.
    """

    def __init__(self, threshold_dbfs: float = DEFAULT_AUDIBLE_DBFS):
        self.threshold = dbfs_to_s16_amplitude(threshold_dbfs)
        self.samples_seen = 0
        self.first_audible_sample: int | None = None
        self._carry = b""

    @property
    def found(self) -> bool:
        return self.first_audible_sample is not None

    def feed(self, data: bytes) -> bool:
        """Consume one chunk; True when this chunk holds the first audible sample."""
        if self.found or not data:
            return False
        buf = self._carry + data
        whole = len(buf) - len(buf) % BYTES_PER_SAMPLE
        self._carry = buf[whole:]
        samples = np.frombuffer(buf[:whole], dtype="<i2").astype(np.int32)
        loud = np.flatnonzero(np.abs(samples) >= self.threshold)
        if loud.size:
            self.first_audible_sample = self.samples_seen + int(loud[0])
        self.samples_seen += samples.size
        return self.found


@dataclass
class RequestRecord:
    """Everything measured about one request; times are seconds, chunk times relative to send."""

    index: int
    prompt_index: int
    start_s: float
    ok: bool
    status: str
    error: str | None = None
    ttfa_s: float | None = None
    first_audible_s: float | None = None
    e2e_s: float | None = None
    audio_s: float = 0.0
    rtf: float | None = None
    max_underrun_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_bytes: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_record(
    *,
    index: int,
    prompt_index: int,
    start_s: float,
    chunk_times_s: Sequence[float],
    chunk_bytes: Sequence[int],
    e2e_s: float | None,
    ok: bool,
    status: str,
    error: str | None = None,
    first_audible_s: float | None = None,
    audio_s: float | None = None,
    extra: dict[str, Any] | None = None,
) -> RequestRecord:
    """Derive TTFA, audio duration, RTF and max underrun from a stream's chunk trace.

    `audio_s` defaults to the PCM byte count at 48000 bytes/s. RTF and underrun are only set for a
    request that delivered audio.
    """
    times = [float(t) for t in chunk_times_s]
    sizes = [int(n) for n in chunk_bytes]
    nonempty = [t for t, n in zip(times, sizes, strict=True) if n > 0]
    ttfa = nonempty[0] if nonempty else None
    audio = sum(sizes) / PCM_BYTES_PER_SECOND if audio_s is None else float(audio_s)
    rtf = e2e_s / audio if (e2e_s is not None and audio > 0) else None
    underrun = max_underrun_s(times, sizes) if nonempty else None
    return RequestRecord(
        index=index,
        prompt_index=prompt_index,
        start_s=start_s,
        ok=ok,
        status=status,
        error=error,
        ttfa_s=ttfa,
        first_audible_s=first_audible_s,
        e2e_s=e2e_s,
        audio_s=audio,
        rtf=rtf,
        max_underrun_s=underrun,
        chunk_times_s=times,
        chunk_bytes=sizes,
        extra=dict(extra or {}),
    )


def percentiles(values: Iterable[float | None], qs: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """p50/p90/... (linear interpolation between order statistics) and the mean; None when empty."""
    data = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    out: dict[str, float | None] = {}
    for q in qs:
        key = f"p{q:g}"
        out[key] = float(np.percentile(data, q)) if data.size else None
    out["mean"] = float(data.mean()) if data.size else None
    out["max"] = float(data.max()) if data.size else None
    return out


LATENCY_FIELDS = ("ttfa_s", "first_audible_s", "e2e_s", "rtf", "max_underrun_s")
# Admission control's answer to overload (HTTP 429 / gRPC RESOURCE_EXHAUSTED), given at once.
REFUSAL_STATUSES = frozenset({"429", "RESOURCE_EXHAUSTED"})


def is_refusal(record: RequestRecord) -> bool:
    """A request the server refused before any audio: a refusal status and no audio byte.

    The same status after audio started is a stream that broke, counted with the other errors.
    """
    return not record.ok and record.status in REFUSAL_STATUSES and not any(n > 0 for n in record.chunk_bytes)


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Aggregates of one load level.

    Latency percentiles, RTF and underrun are over successful requests (a failed stream has no
    meaningful end-to-end time). xRT counts every audio second delivered, including the part of a
    stream that later failed. A request *passes* when it succeeded with zero underrun (Nari Labs'
    protocol: a row with any late chunk does not pass).

    Failures split into refusals (`is_refusal`: admission control said no before any audio;
    `num_refused`, `refusals` by status, `refused_share` of all requests, and `refusal_latency_s`,
    send -> refusal) and errors (everything else: `num_errors`, `errors` by status);
    `num_failed` is both together.
    """
    ok = [r for r in records if r.ok]
    refused = [r for r in records if is_refusal(r)]
    errored = [r for r in records if not r.ok and not is_refusal(r)]
    n = len(records)
    zero_underrun = [r for r in ok if r.max_underrun_s is not None and r.max_underrun_s <= 0.0]
    audio_total = sum(r.audio_s for r in records)
    out: dict[str, Any] = {
        "num_requests": n,
        "num_ok": len(ok),
        "num_failed": n - len(ok),
        "num_refused": len(refused),
        "num_errors": len(errored),
        "refused_share": len(refused) / n if n else None,
        "success_rate": len(ok) / n if n else None,
        "zero_underrun_share": len(zero_underrun) / len(ok) if ok else None,
        "pass_rate": len(zero_underrun) / n if n else None,
        "wall_s": wall_s,
        "audio_s_total": audio_total,
        "xrt": audio_total / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "errors": dict(Counter(r.status for r in errored)),
        "refusals": dict(Counter(r.status for r in refused)),
    }
    for name in LATENCY_FIELDS:
        out[name] = percentiles(getattr(r, name) for r in ok)
    out["refusal_latency_s"] = percentiles(r.e2e_s for r in refused)
    # Tail against median: a flat TTFA tail stays near 1, a queueing server drifts far above it.
    ttfa = out["ttfa_s"]
    out["ttfa_p99_over_p50"] = ttfa["p99"] / ttfa["p50"] if ttfa["p50"] and ttfa["p99"] is not None else None
    # With random weights end of speech comes at random: the audio per request shows what was measured.
    out["audio_s"] = percentiles(r.audio_s for r in ok)
    return out
