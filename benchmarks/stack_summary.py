"""One screen of a stack run: the client's table and what the services saw, from a run's folder.

`benchmarks/launch_gpu_stack.sh` leaves, per stack, the client's `results.json` (one per sweep:
the first, `then/`, `back/`) and every service's `/metrics` page scraped after the sweeps
(`metrics-<service>.txt`). This prints, for every such folder under the roots given:

- per load level: requests that succeeded, admitted streams gap-free, refusal latency, first audio
  (p50 / p95) and audio-s/s;
- per service: its start-up, phase by phase; event-loop lag (p50 / p99 from the histogram's buckets, "<=" the bucket's bound,
  and the worst sample), how long calls from the other services waited before their handler ran,
  the talker's admission capacity over the run's steps and the costs it last worked with,
  code2wav's decode calls (streams, frames, time) and the cost it published,
  underruns, the stages' mean times and the chunk hops' means;
- each burst's first seconds from the talker's admission trace, when the stack wrote one
  (`ADMISSION_TRACE=1`; benchmarks/admission_timeline.py);
- the late chunks the talker logged (`logs/talker.log`: "audio up to frame N handed on N ms
  late"), by the frame their chunk ended at, with each hop's mean and, where code2wav said how
  long it held them, its hop split into held and in transit;
- each service's event-loop stalls whose loop-thread stack it logged (`STALL_DUMP_MS`), with where
  that thread was;
- the commonest failure statuses and messages per level (numbers in the messages folded, so alike
  ones group) and the idle
  refusal probe, when the client ran one.

    python -m benchmarks.stack_summary run/stacks        # every results.json and metrics-*.txt below
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks import admission_timeline
from benchmarks.metrics import REFUSAL_STATUSES, percentiles
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE, SAMPLES_PER_FRAME
from services.talker.admission_trace import read_trace

# Stages worth a mean per service (tts_stage_latency_seconds{stage}); the rest stay in the file.
STAGES = {
    "talker": ("prompt_queue", "build_prompt", "prefill", "admit"),
    "code2wav": ("open_stream",),
    "gateway": (),
}
BURST_S = 1.0  # a level's opening burst, for the refusal latency split
HOP_HISTOGRAMS = (
    "tts_talker_chunk_hop_seconds",
    "tts_talker_first_chunk_hop_seconds",
    "tts_gateway_first_chunk_hop_seconds",
    "tts_gateway_refusal_hop_seconds",
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}"


def level_rows(result: dict[str, Any]) -> list[dict[str, str]]:
    """The table's rows of one results.json (one per load level)."""
    rows = []
    for level in result.get("levels", []):
        a = level["aggregates"]
        refused = a.get("refusal_latency_s") or {}
        ttfa = a.get("ttfa_s") or {}
        load = level.get("concurrency") or level.get("rate")
        xrt = a.get("xrt")
        rows.append(
            {
                "load": f"c={load}" if level.get("concurrency") else f"{load} RPS",
                "ok %": _pct(a.get("success_rate")),
                "gap-free %": _pct(a.get("zero_underrun_share")),
                "refused ms p50/p95": f"{_ms(refused.get('p50'))}/{_ms(refused.get('p95'))}",
                "TTFA ms p50/p95": f"{_ms(ttfa.get('p50'))}/{_ms(ttfa.get('p95'))}",
                "xRT": "-" if xrt is None else f"{xrt:.0f}",
            }
        )
    return rows


def failure_lines(result: dict[str, Any], top: int = 4) -> list[str]:
    """The commonest failure messages per level, digits folded to N, with their end-to-end p50."""
    lines = []
    for level in result.get("levels", []):
        by_message: dict[str, list[float]] = collections.defaultdict(list)
        for record in level.get("records", []):
            if not record.get("ok"):
                folded = re.sub(r"\b\d+(\.\d+)?\b", "N", str(record.get("error") or ""))
                by_message[f"{record.get('status')}: {folded}"[:100]].append(record.get("e2e_s") or 0.0)
        load = level.get("concurrency") or level.get("rate")
        for message, times in sorted(by_message.items(), key=lambda kv: -len(kv[1]))[:top]:
            times.sort()
            lines.append(
                f"  {load}: {len(times)} x {message!r}, end to end p50 {times[len(times) // 2]:.2f} s"
            )
        if (split := burst_split(level.get("records", []))) is not None:
            lines.append(f"  {load}: {split}")
        if (opening := opening_split(level.get("records", []), level.get("concurrency") or 0)) is not None:
            lines.append(f"  {load}: {opening}")
        if (by_first := first_chunk_split(level.get("records", []))) is not None:
            lines.append(f"  {load}: {by_first}")
        if level.get("probe"):
            lines.append(f"  {load}: idle refusal probe {json.dumps(level['probe'])[:200]}")
        if lag := level.get("client_loop_lag_ms"):
            lines.append(
                f"  {load}: the client's own event loop woke late by p50 / p99 / max "
                f"{lag['p50']:.1f} / {lag['p99']:.1f} / {lag['max']:.0f} ms"
            )
    return lines


def first_chunk_split(records: Sequence[dict[str, Any]]) -> str | None:
    """First audio of the successful streams by the size of their first chunk, in frames (its
    share of the stream's bytes times the stream's audio, 80 ms a frame: exact for PCM and WAV):
    which start the talker gave a stream shows in its first audio. None without a stream."""
    by_frames: dict[int, list[float]] = collections.defaultdict(list)
    for r in records:
        sizes = r.get("chunk_bytes") or ()
        total, audio, ttfa = sum(sizes), r.get("audio_s"), r.get("ttfa_s")
        if not r.get("ok") or not sizes or total <= 0 or not audio or ttfa is None:
            continue
        by_frames[max(1, round(audio * sizes[0] / total * NATIVE_SAMPLE_RATE / SAMPLES_PER_FRAME))].append(
            ttfa
        )
    if not by_frames:
        return None
    parts = []
    for frames, times in sorted(by_frames.items()):
        q = percentiles(times, (50, 95))
        parts.append(f"{frames}: {len(times)}, p50 / p95 {_ms(q['p50'])} / {_ms(q['p95'])} ms")
    return "first audio by first chunk (frames: streams, p50 / p95): " + "; ".join(parts)


def opening_split(records: Sequence[dict[str, Any]], concurrency: int) -> str | None:
    """A closed loop's opening burst (its first `concurrency` requests, every client's first): how
    long they took to send, how many were let in, and when the last of those heard audio. The
    talker publishes room for what its forecast says can start within part of the first-audio
    budget at its measured drain rate; the let-in share beside how soon they all started says how
    far that forecast was from the queue's real drain. None for an open loop or a level without
    its whole opening."""
    timed = sorted((r for r in records if r.get("start_s") is not None), key=lambda r: r["start_s"])
    if concurrency <= 0 or len(timed) < concurrency:
        return None
    opening = timed[:concurrency]
    sent_s = opening[-1]["start_s"] - opening[0]["start_s"]
    ttfa = [r["ttfa_s"] for r in opening if r.get("ok") and r.get("ttfa_s") is not None]
    text = f"opening: the first {concurrency} requests sent over {sent_s:.2f} s, {len(ttfa)} let in"
    if ttfa:
        q = percentiles(ttfa, (95,))
        last = max(ttfa)
        text += f", their first audio p95 / max {_ms(q['p95'])} / {_ms(last)} ms"
        if len(ttfa) < concurrency and sent_s + last > 0:
            # Every one let in had started within this long of the opening's first send.
            text += f" (the queue drained >= {len(ttfa) / (sent_s + last):.0f} a second)"
    return text


def burst_split(records: Sequence[dict[str, Any]], burst_s: float = BURST_S) -> str | None:
    """Refusal latency (send to refusal, as the client's table) of the requests sent in a level's
    first `burst_s` against those sent later: a closed loop opens with every client at once, and
    the front takes new calls one loop turn at a time, so the opening burst's refusals wait for
    the accepted ones' start; the steady state's come as the loop is free. None without refusals."""
    refused = [
        r
        for r in records
        if not r.get("ok")
        and str(r.get("status")) in REFUSAL_STATUSES
        and not any(n > 0 for n in r.get("chunk_bytes") or ())
        and r.get("start_s") is not None
        and r.get("e2e_s") is not None
    ]
    if not refused:
        return None
    first = min(r["start_s"] for r in records if r.get("start_s") is not None)
    parts = []
    for name, group in (
        (f"sent in the first {burst_s:g} s", [r["e2e_s"] for r in refused if r["start_s"] - first < burst_s]),
        ("later", [r["e2e_s"] for r in refused if r["start_s"] - first >= burst_s]),
    ):
        if group:
            q = percentiles(group, (50, 95))
            parts.append(f"{name} {len(group)}, p50 / p95 {_ms(q['p50'])} / {_ms(q['p95'])} ms")
    return "refusals " + "; ".join(parts)


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the first bucket that holds quantile `q` of a cumulative histogram
    ((le, count) pairs in order, +Inf last); None when it is empty or `q` falls past the last
    finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    want = q * buckets[-1][1]
    for le, count in buckets:
        if count >= want:
            return None if math.isinf(le) else le
    return None


class ScrapedMetrics:
    """One service's scraped /metrics page, read with prometheus_client's parser."""

    def __init__(self, text: str):
        self.samples: list[tuple[str, dict[str, str], float]] = []
        for family in text_string_to_metric_families(text):
            self.samples.extend((s.name, s.labels, s.value) for s in family.samples)

    def values(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [
            (lab, v)
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == want for k, want in labels.items())
        ]

    def total(self, name: str, **labels: str) -> float:
        return sum(v for _, v in self.values(name, **labels))

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        summed: dict[float, float] = collections.defaultdict(float)
        for lab, value in self.values(f"{name}_bucket", **labels):
            summed[float(lab["le"])] += value
        return sorted(summed.items())

    def mean(self, name: str, **labels: str) -> tuple[float, float] | None:
        """(count, mean) of a histogram's observations, or None without any."""
        count = self.total(f"{name}_count", **labels)
        return (count, self.total(f"{name}_sum", **labels) / count) if count else None

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({lab[label] for lab, _ in self.values(f"{name}_count") if label in lab})


def startup_line(metrics: ScrapedMetrics) -> list[str]:
    """The service's start-up, phase by phase (tts_startup_seconds), 'serving' (process start to
    its first SERVING) first."""
    phases = {lab["phase"]: v for lab, v in metrics.values("tts_startup_seconds")}
    if not phases:
        return []
    order = sorted(phases, key=lambda p: (p != "serving", p))
    return ["  start-up: " + ", ".join(f"{p} {phases[p]:.1f} s" for p in order)]


def service_lines(service: str, metrics: ScrapedMetrics) -> list[str]:
    lines = startup_line(metrics)
    lag = metrics.buckets("tts_event_loop_lag_seconds")
    if lag:
        p50, p99 = bucket_quantile(lag, 0.5), bucket_quantile(lag, 0.99)
        worst = metrics.total("tts_event_loop_lag_max_seconds")
        lines.append(
            f"  event-loop lag p50 <= {_ms(p50)} ms, p99 <= {_ms(p99)} ms over {lag[-1][1]:.0f} samples; "
            f"worst since the last scrape {_ms(worst)} ms"
        )
    accept = metrics.buckets("tts_rpc_accept_seconds")
    if accept and accept[-1][1] > 0:
        waited = metrics.mean("tts_rpc_accept_seconds")
        lines.append(
            f"  calls waited before their handler: mean {_ms(waited[1])} ms, p95 <= "
            f"{_ms(bucket_quantile(accept, 0.95))} ms over {accept[-1][1]:.0f} calls"
        )
    lines.extend(admission_lines(metrics))
    # A gateway's requests by their end: with several gateways, whose share of the room ran out.
    ends = {
        f"{lab.get('protocol', '?')} {lab.get('status', '?')}": v
        for lab, v in metrics.values("tts_gateway_requests_total")
        if v > 0
    }
    if ends:
        lines.append("  requests by end: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(ends.items())))
    lines.extend(start_plan_lines(metrics))
    lines.extend(step_lines(metrics))
    lines.extend(decode_lines(metrics))
    underruns = metrics.total(f"tts_{service}_underruns_total")
    if metrics.values(f"tts_{service}_underruns_total"):
        lines.append(f"  underruns {underruns:.0f}")
    if metrics.values("tts_talker_refused_total"):  # the talker's admission refusals, and where
        refused = metrics.total("tts_talker_refused_total")
        at_front = metrics.total("tts_talker_room_refused_total")
        lines.append(
            f"  refused by admission {refused:.0f}, of them {at_front:.0f} at once by the front "
            "(the engine's last room)"
        )
    for stage in STAGES.get(service, ()):
        if (got := metrics.mean("tts_stage_latency_seconds", stage=stage)) is not None:
            lines.append(f"  stage {stage}: n={got[0]:.0f}, mean {got[1] * 1e3:.1f} ms")
    for name in HOP_HISTOGRAMS:
        if not name.startswith(f"tts_{service}_"):
            continue
        hops = []
        for hop in metrics.label_values(name, "hop"):
            if (got := metrics.mean(name, hop=hop)) is not None:
                hops.append(f"{hop} {got[1] * 1e3:.1f}")
        if hops:
            lines.append(f"  {name.removeprefix('tts_')} means (ms): " + ", ".join(hops))
    transit = metrics.mean("tts_talker_code2wav_transit_seconds") if service == "talker" else None
    if transit:  # of the code2wav hop, what code2wav did not hold: both trips and both loops
        p95 = bucket_quantile(metrics.buckets("tts_talker_code2wav_transit_seconds"), 0.95)
        lines.append(
            f"  code2wav hop in transit (not held by code2wav): mean {transit[1] * 1e3:.1f} ms, p95 <= "
            + ("-" if p95 is None else f"{p95 * 1e3:g} ms")
            + f" over {transit[0]:.0f} chunks"
        )
    queued = metrics.mean("tts_talker_code2wav_audio_queued_seconds") if service == "talker" else None
    if queued:  # of the transit, the audio's wait on the talker's own loop and queues
        p95 = bucket_quantile(metrics.buckets("tts_talker_code2wav_audio_queued_seconds"), 0.95)
        lines.append(
            f"  of it queued on the talker (read off the call to the stream's task): mean {queued[1] * 1e3:.1f} ms, "
            + ("p95 <= -" if p95 is None else f"p95 <= {p95 * 1e3:g} ms")
            + f" over {queued[0]:.0f} chunks"
        )
    waits = []  # a gateway's requests that found its share of the room spent (--talker-room-wait-ms)
    for outcome in ("room", "refused"):
        if (got := metrics.mean("tts_gateway_room_wait_seconds", outcome=outcome)) is not None and got[0]:
            waits.append(
                f"{got[0]:.0f} {'got room' if outcome == 'room' else outcome}, mean {got[1] * 1e3:.1f} ms"
            )
    if waits:
        lines.append("  waits for a spent room share: " + ", ".join(waits))
    writes = []
    for method in metrics.label_values("tts_session_write_seconds", "method"):
        if (got := metrics.mean("tts_session_write_seconds", method=method)) is not None:
            writes.append(f"{method.rsplit('/', 1)[-1]} {got[1] * 1e3:.1f} ms over {got[0]:.0f}")
    if writes:  # the part of the hops to the next stage that a session's queueing hides
        lines.append("  session writes (oldest queued to written), means: " + ", ".join(writes))
    return lines


def admission_lines(metrics: ScrapedMetrics) -> list[str]:
    """The talker's admission capacity over the run's steps (p5 / p50 / p95, bucket bounds) and
    the costs it last worked with: how far the estimate moved, and from what."""
    cap = metrics.buckets("tts_talker_admission_capacity_streams")
    if not cap or cap[-1][1] <= 0:
        return []
    q = [bucket_quantile(cap, p) for p in (0.05, 0.5, 0.95)]
    over = metrics.total("tts_talker_steps_over_capacity_total")
    line = (
        "  admission capacity p5/p50/p95 <= "
        + "/".join("-" if v is None else f"{v:.0f}" for v in q)
        + f" streams over {cap[-1][1]:.0f} steps, {over:.0f} with more running"
    )
    room = metrics.buckets("tts_talker_published_room_streams")
    if room and room[-1][1] > 0:
        rq = [bucket_quantile(room, p) for p in (0.05, 0.5, 0.95)]
        none = next((n for le, n in room if le == 0), 0)
        line += (
            "; room sent to gateways p5/p50/p95 <= "
            + "/".join("-" if v is None else f"{v:.0f}" for v in rq)
            + f" over {room[-1][1]:.0f} messages, {none:.0f} with none"
        )
    took = metrics.mean("tts_talker_room_seconds")
    twice = metrics.mean("tts_talker_room_calls_seen_meanwhile")
    if took and twice:
        p95 = bucket_quantile(metrics.buckets("tts_talker_room_seconds"), 0.95)
        p95_calls = bucket_quantile(metrics.buckets("tts_talker_room_calls_seen_meanwhile"), 0.95)
        line += (
            f"; rooms worked out in {took[1] * 1e3:.1f} ms on average (p95 <= "
            + ("-" if p95 is None else f"{p95 * 1e3:g} ms")
            + f"), the gateway's calls seen meanwhile {twice[1]:.1f} on average (p95 <= "
            + ("-" if p95_calls is None else f"{p95_calls:.0f}")
            + ")"
        )
    costs = {lab["cost"]: v for lab, v in metrics.values("tts_talker_admission_cost_seconds")}
    if costs:
        line += (
            f"; last costs: step {costs.get('step_base', 0) * 1e3:.2f} ms + "
            f"{costs.get('step_per_stream', 0) * 1e6:.1f} us a stream, prefill "
            f"{costs.get('prefill_request', 0) * 1e3:.1f} ms a request, decoder "
            f"{costs.get('decoder_frame', 0) * 1e6:.1f} us a frame"
        )
    return [line]


def step_lines(metrics: ScrapedMetrics) -> list[str]:
    """The talker's frame steps and prefill steps (count, mean), and the wait from admission to a
    prompt's prefill step (mean, p50 / p90 bucket bounds): where a first chunk's "generate" goes."""
    parts = []
    for name, what in (
        ("tts_talker_step_seconds", "steps"),
        ("tts_talker_prefill_seconds", "with a prefill"),
    ):
        if (got := metrics.mean(name)) is not None and got[0] > 0:
            parts.append(f"{got[0]:.0f} {what}, mean {got[1] * 1e3:.1f} ms")
    wait = metrics.buckets("tts_talker_prefill_wait_seconds")
    if wait and wait[-1][1] > 0 and (got := metrics.mean("tts_talker_prefill_wait_seconds")) is not None:
        q = [bucket_quantile(wait, p) for p in (0.5, 0.9)]
        parts.append(
            f"admission to prefill mean {got[1] * 1e3:.1f} ms, p50 / p90 <= "
            + " / ".join(_ms(v) for v in q)
            + " ms"
        )
    return ["  talker steps: " + "; ".join(parts)] if parts else []


def start_plan_lines(metrics: ScrapedMetrics) -> list[str]:
    """How many new streams asked for each first chunk, and why (counts, timing, request)."""
    plans = [
        (lab.get("first", "?"), lab.get("why", "?"), v)
        for lab, v in metrics.values("tts_talker_start_plans_total")
    ]
    plans = [p for p in plans if p[2] > 0]
    if not plans:
        return []
    order = {"default": 0}
    plans.sort(key=lambda p: (order.get(p[0], 1), int(p[0]) if p[0].isdigit() else 0, p[1]))
    lines = ["  first chunks asked (frames, why): " + ", ".join(f"{f} {w} {v:.0f}" for f, w, v in plans)]
    misfits = sorted(
        (lab.get("first", "?"), lab.get("bound", "?"), v)
        for lab, v in metrics.values("tts_talker_start_plan_misfits_total")
        if v > 0
    )
    if misfits:  # which bound of the timing check turned the smaller starts down
        lines.append(
            "  smaller starts turned down (frames, bound): "
            + ", ".join(f"{f} {b} {v:.0f}" for f, b, v in misfits)
        )
    return lines


def decode_lines(metrics: ScrapedMetrics) -> list[str]:
    """code2wav's decode calls (how many, their mean streams, frames and time) and the cost it
    last published: a per-frame cost far above the engine's own lowers the talker's capacity."""
    calls = metrics.mean("tts_code2wav_decode_seconds")
    if calls is None or calls[0] <= 0:
        return []
    streams = metrics.mean("tts_code2wav_decode_batch_streams")
    frames = metrics.mean("tts_code2wav_decode_batch_frames")
    line = f"  decode calls: {calls[0]:.0f}, mean {calls[1] * 1e3:.1f} ms"
    if streams is not None:
        line += f", {streams[1]:.1f} streams"
    if frames is not None:
        line += f", {frames[1]:.1f} frames"
    costs = {lab["cost"]: v for lab, v in metrics.values("tts_code2wav_decode_cost_seconds")}
    if costs:
        line += (
            f"; published cost {costs.get('call', 0) * 1e3:.2f} ms a call + "
            f"{costs.get('frame', 0) * 1e6:.1f} us a frame"
        )
    lines = [line]
    waits = []
    for name, what in (
        ("tts_code2wav_first_chunk_wait_seconds", "first chunks"),
        ("tts_code2wav_first_chunk_state_wait_seconds", "first chunks for their decoder state"),
        ("tts_code2wav_chunk_wait_seconds", "all chunks"),
    ):
        if (got := metrics.mean(name)) is not None and got[0] > 0:
            waits.append(f"{what} {got[1] * 1e3:.1f} ms over {got[0]:.0f}")
    if waits:  # from a chunk's last frame to its decode call: the state's making and the loop's turn
        lines.append("  chunks waited for a decode call, means: " + ", ".join(waits))
    if (got := metrics.mean("tts_code2wav_session_message_wait_seconds")) is not None and got[0] > 0:
        # the talker's messages from their read off the session call to their stream taking them
        p95 = bucket_quantile(metrics.buckets("tts_code2wav_session_message_wait_seconds"), 0.95)
        lines.append(
            f"  session messages read to their stream: mean {got[1] * 1e3:.1f} ms, "
            + ("p95 <= -" if p95 is None else f"p95 <= {p95 * 1e3:g} ms")
            + f" over {got[0]:.0f}"
        )
    hits = metrics.total("tts_code2wav_prefix_state_hits_total")
    misses = metrics.total("tts_code2wav_prefix_state_misses_total")
    if hits or misses:
        lines.append(f"  decoder states after a reference prefix: {hits:.0f} copied, {misses:.0f} decoded")
    return lines


LATE_CHUNK = re.compile(r"audio up to frame (\d+) handed on (\d+) ms late; (.*)$")
HOP_MS = re.compile(
    r"(\w+) (-?\d+) ms(?: \(held there (\d+) ms, in transit (\d+) ms(?:, queued here (\d+) ms)?\))?"
)


STALLED = re.compile(r"the event loop stalled (\d+) ms")
STALL_STACK = re.compile(r"the event loop is \d+ ms late; its thread's stack")
STACK_FRAME = re.compile(r'^  File "([^"]+)", line (\d+), in (\S+)$')


def stall_lines(log_text: str, top: int = 3) -> list[str]:
    """A service's event-loop stalls whose stack it logged (TTS_STALL_DUMP_MS,
    qtts/serving/loop_lag.py): how many, the longest, and where the loop's thread was (its
    innermost two frames, the commonest first)."""
    stalls = [int(m.group(1)) for m in STALLED.finditer(log_text)]
    wheres: collections.Counter[str] = collections.Counter()
    frames: list[str] | None = None
    for line in [*log_text.splitlines(), ""]:
        if frames is not None:
            if (m := STACK_FRAME.match(line)) is not None:
                frames.append(f"{m.group(3)} ({Path(m.group(1)).name}:{m.group(2)})")
                continue
            if line.startswith("    "):  # a frame's source line
                continue
            if frames:
                wheres[" < ".join(reversed(frames[-2:]))] += 1
            frames = None
        if STALL_STACK.search(line):
            frames = []
    if not stalls and not wheres:
        return []
    out = [
        f"  event-loop stalls with the loop's stack logged: {len(stalls)}"
        + (f", longest {max(stalls)} ms" if stalls else "")
    ]
    out.extend(f"    loop thread at {where}: {n}" for where, n in wheres.most_common(top))
    return out


def late_chunk_lines(log_text: str, top: int = 4) -> list[str]:
    """The talker's late chunks (chunk_hops' log lines) grouped by the frame their chunk ended at,
    the commonest first: how many, how late at the median, and each hop's mean (ms); code2wav's
    hop split into what code2wav held and the transit where the lines say."""
    late: dict[int, list[tuple[int, dict[str, int]]]] = collections.defaultdict(list)
    for line in log_text.splitlines():
        if (m := LATE_CHUNK.search(line)) is None:
            continue
        hops: dict[str, int] = {}
        for hop in HOP_MS.finditer(m.group(3)):
            hops[hop.group(1)] = int(hop.group(2))
            if hop.group(3) is not None:
                hops["held there"], hops["in transit"] = int(hop.group(3)), int(hop.group(4))
            if hop.group(5) is not None:
                hops["queued here"] = int(hop.group(5))
        late[int(m.group(1))].append((int(m.group(2)), hops))
    if not late:
        return []
    out = [f"  late chunks logged: {sum(map(len, late.values()))}"]
    for end, chunks in sorted(late.items(), key=lambda kv: -len(kv[1]))[:top]:
        names: list[str] = []
        for _, hops in chunks:
            names.extend(n for n in hops if n not in names)
        means = []
        for name in names:
            got = [hops[name] for _, hops in chunks if name in hops]
            means.append(f"{name} {sum(got) / len(got):.0f}")
        lateness = sorted(ms for ms, _ in chunks)[len(chunks) // 2]
        out.append(
            f"    ending at frame {end}: {len(chunks)}, late p50 {lateness} ms; hop means (ms): "
            + ", ".join(means)
        )
    return out


def cpu_lines(page: Path, metrics: ScrapedMetrics, level_s: float = 0.0) -> list[str]:
    """The service process's CPU time between the idle requests' scrape (`idle/`, launch_gpu_stack.sh
    IDLE_FIRST) and this one (the pages' modification times apart), and, over `level_s` (the
    levels' wall time), the cores that is at most: the client's warm-up between the two counts
    too. A process near one core is bound by its Python. (The talker's page counts its front
    process: the engine process's own process_* samples are not merged into it.)"""
    before = page.parent / "idle" / page.name
    if not before.is_file():
        return []
    start = ScrapedMetrics(before.read_text()).total("process_cpu_seconds_total")
    end = metrics.total("process_cpu_seconds_total")
    seconds = page.stat().st_mtime - before.stat().st_mtime
    if not end or seconds <= 0:
        return []
    line = f"  CPU since the idle requests' scrape ({seconds:.0f} s before): {end - start:.1f} s"
    if level_s > 0:
        line += f"; over the levels' {level_s:.0f} s, {(end - start) / level_s:.2f} cores at most"
    return [line]


# nvidia-smi's ways of saying there is nothing to list.
_NONE_SAID = ("No devices were found", "No running processes found")


def leftover_lines(run: Path) -> list[str]:
    """What outlived the stack (run_h200.sh stacks' leftovers.txt: processes still running a
    second after it was stopped, and the GPU's compute processes), when anything did."""
    path = run / "leftovers.txt"
    if not path.is_file():
        return []
    found: dict[str, list[str]] = {"processes": [], "gpu": []}
    section = None
    for line in path.read_text(errors="replace").splitlines():
        if line.strip() in ("processes:", "gpu:"):
            section = line.strip()[:-1]
        elif section is not None and line.strip() and not line.strip().startswith(_NONE_SAID):
            found[section].append(line.strip())
    if not (found["processes"] or found["gpu"]):
        return []
    lines = [
        f"  left running after the stack stopped (killed before the next): {len(found['processes'])} processes"
    ]
    lines += [f"    {line[:160]}" for line in found["processes"][:6]]
    lines += [f"    gpu: {line[:160]}" for line in found["gpu"][:6]]
    return lines


def runs_under(roots: Iterable[Path]) -> list[Path]:
    """Every folder below `roots` (themselves included) with a results.json or a metrics page."""
    found: set[Path] = set()
    for root in roots:
        for path in [*root.rglob("results.json"), *root.rglob("metrics-*.txt")]:
            found.add(path.parent)
    return sorted(found)


def summary(roots: Sequence[Path]) -> str:
    out: list[str] = []
    header = ("load", "ok %", "gap-free %", "refused ms p50/p95", "TTFA ms p50/p95", "xRT")
    for run in runs_under(roots):
        name = next((str(run.relative_to(r)) or "." for r in roots if run.is_relative_to(r)), str(run))
        out.append(f"== {name}")
        # The revision and the host it ran on (run_h200.sh stacks: CPU, cores, a Python loop's time),
        # so figures of two calls are read with their hosts.
        if (run / "revision.txt").is_file():
            out.extend(
                "  " + line.strip()
                for line in (run / "revision.txt").read_text().splitlines()
                if line.strip()
            )
        # The host over this sweep (launch_gpu_stack.sh, benchmarks/host_probe.py): busy, steal and
        # a Python loop's time before and after, so a slow or shared host shows beside its figures.
        if (run / "host-cpu.json").is_file():
            try:
                out.append("  " + json.loads((run / "host-cpu.json").read_text())["line"])
            except (ValueError, KeyError) as exc:
                out.append(f"  host-cpu.json unreadable: {exc}")
        out.extend(leftover_lines(run))
        result_path = run / "results.json"
        level_s = 0.0
        if result_path.exists():
            result = json.loads(result_path.read_text())
            level_s = sum(level.get("wall_s") or 0.0 for level in result.get("levels", []))
            out.append("| " + " | ".join(header) + " |")
            out.extend("| " + " | ".join(row[h] for h in header) + " |" for row in level_rows(result))
            out.extend(failure_lines(result))
        for page in sorted(run.glob("metrics-*.txt")):
            service = page.stem.removeprefix("metrics-")
            metrics = ScrapedMetrics(page.read_text())
            lines = service_lines(service.split("-")[0], metrics) + cpu_lines(page, metrics, level_s)
            if lines:
                out.append(f"{service}:")
                out.extend(lines)
        # The services' logs: logs/ under a GPU stack's folder, beside the pages on stack_host's.
        logs = sorted(run.glob("logs/*.log")) or sorted(p for p in run.glob("*.log") if p.stem != "launcher")
        for log in logs:
            if stalled := stall_lines(log.read_text(errors="replace")):
                out.append(f"{log.stem} (its log):")
                out.extend(stalled)
        for log in logs:
            if log.stem == "talker":
                out.extend(late_chunk_lines(log.read_text(errors="replace")))
        # The talker's admission trace (ADMISSION_TRACE=1): each burst's first seconds.
        for trace in sorted([*run.glob("admission-trace.jsonl"), *run.glob("admission-trace.jsonl.gz")]):
            out.append(f"admission ({trace.name}):")
            out.append(admission_timeline.report(read_trace(trace), 32, 0.2, 3.0, trace.name))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="folders a stack run left")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.roots if not r.is_dir()]
    if missing:
        parser.error(f"no such folder: {', '.join(missing)}")
    text = summary(args.roots)
    print(text or "no results.json or metrics-*.txt below " + ", ".join(map(str, args.roots)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
