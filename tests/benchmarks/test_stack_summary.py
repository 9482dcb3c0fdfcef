"""`benchmarks.stack_summary`: the client's table and the services' view of a stack run, from
results.json files and scraped /metrics pages as launch_gpu_stack.sh leaves them."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.stack_summary import (
    bucket_quantile,
    failure_lines,
    first_chunk_split,
    main,
    opening_split,
    summary,
)
from qtts.serving.metrics import Code2WavMetrics, TalkerMetrics


def level(concurrency, records, **aggregates):
    base = {"success_rate": 0.5, "zero_underrun_share": 0.75, "xrt": 412.4}
    base.update(aggregates)
    return {"concurrency": concurrency, "aggregates": base, "records": records}


def write_run(tmp_path):
    run = tmp_path / "http1"
    (run / "then").mkdir(parents=True)
    records = [
        {"ok": True, "e2e_s": 10.0, "start_s": 5.0},
        {
            "ok": False,
            "e2e_s": 0.04,
            "status": "429",
            "error": "every talker is at capacity (3 ready)",
            "start_s": 5.2,
        },
        {
            "ok": False,
            "e2e_s": 0.06,
            "status": "429",
            "error": "every talker is at capacity (4 ready)",
            "start_s": 7.0,
        },
        {"ok": False, "e2e_s": 2.5, "status": "503", "error": "code2wav replica c2w-1 stalled for 2.5 s"},
    ]
    first = level(
        768,
        records,
        refusal_latency_s={"p50": 0.05, "p95": 0.0598},
        ttfa_s={"p50": 0.6561, "p95": 4.79},
    )
    first["probe"] = {"p50_s": 0.004}
    (run / "results.json").write_text(json.dumps({"levels": [first]}))
    (run / "then" / "results.json").write_text(json.dumps({"levels": [level(1024, [], xrt=None)]}))

    talker = TalkerMetrics(CollectorRegistry())
    for lag in [0.0004] * 98 + [0.02, 0.3]:
        talker.loop_lag.observe(lag)
    talker.underruns_total.inc(7)
    talker.refused_total.inc(12)  # by admission: 5 of them at once by the front (the engine's last room)
    talker.room_refused_total.inc(5)
    for waited in (0.002, 0.004, 1.2):
        talker.rpc_accepted("/talker.v1.TalkerService/Generate", waited)
    talker.observe_stage("prefill", 0.010)
    talker.observe_stage("prefill", 0.020)
    talker.chunk_hop_seconds.labels("code2wav").observe(1.25)
    talker.chunk_hop_seconds.labels("code2wav").observe(0.75)
    for seconds in (0.02, 0.04):  # of those hops, what code2wav did not hold
        talker.code2wav_transit_seconds.observe(seconds)
    for seconds in (0.004, 0.012):
        talker.code2wav_audio_queued_seconds.observe(seconds)
    for seconds in (0.002, 0.004):
        talker.session_written("/code2wav.v1.Code2WavService/DecodeSession", seconds)
    talker.session_written("/talker.v1.TalkerService/Session", 0.010)
    for cap in [600] * 80 + [500] * 10 + [1000] * 10:
        talker.admission_capacity_streams.observe(cap)
    talker.steps_over_capacity_total.inc(4)
    for room in [0] * 6 + [48] * 14 + [200] * 80:  # the room sent to the gateways, message by message
        talker.published_room_streams.observe(room)
    for seconds, calls in [(0.001, 0)] * 90 + [(0.2, 40)] * 10:  # each room's working out
        talker.room_seconds.observe(seconds)
        talker.room_calls_seen_meanwhile.observe(calls)
    for first, why, n in (
        ("default", "counts", 30),
        ("2", "counts", 500),
        ("4", "timing", 70),
        ("4", "counts", 9),
    ):
        talker.start_plans_total.labels(first, why).inc(n)
    talker.start_plan_misfits_total.labels("2", "trip").inc(60)
    talker.start_plan_misfits_total.labels("1", "ramp").inc(5)
    for cost, seconds in (("step_base", 0.0047), ("step_per_stream", 20e-6), ("prefill_request", 0.004)):
        talker.admission_cost_seconds.labels(cost).set(seconds)
    talker.admission_cost_seconds.labels("decoder_frame").set(27e-6)
    (run / "metrics-talker.txt").write_bytes(generate_latest(talker.registry))
    c2w = Code2WavMetrics(CollectorRegistry())
    c2w.observe_stage("open_stream", 0.5)
    c2w.startup.record("load the decoder and capture its graphs", 151.25)
    c2w.startup.record("warm up", 2.0)
    c2w.startup.record("serving", 159.4)
    for streams, frames, seconds in ((4, 16, 0.004), (8, 48, 0.008)):
        c2w.decode_seconds.observe(seconds)
        c2w.decode_batch_streams.observe(streams)
        c2w.decode_batch_frames.observe(frames)
    c2w.decode_cost_seconds.labels("call").set(0.0015)
    c2w.decode_cost_seconds.labels("frame").set(90e-6)
    c2w.first_chunk_wait_seconds.observe(0.030)
    c2w.first_chunk_state_wait_seconds.observe(0.012)
    for seconds in (0.030, 0.010, 0.020):
        c2w.chunk_wait_seconds.observe(seconds)
    for seconds in (0.002, 0.006):
        c2w.session_message_wait_seconds.observe(seconds)
    c2w.prefix_state_hits_total.inc(9)
    c2w.prefix_state_misses_total.inc(2)
    (run / "metrics-code2wav.txt").write_bytes(generate_latest(c2w.registry))
    return tmp_path


def test_the_summary_shows_the_table_the_failures_and_each_services_view(tmp_path):
    run = write_run(tmp_path)
    (run / "http1" / "revision.txt").write_text(
        "revision abc1234\nmodel name\t: AMD EPYC\ncpus 16\npython loop of 3M: 310 ms\n"
    )
    text = summary([run])
    lines = text.splitlines()
    assert lines[0] == "== http1"
    # The revision and the host first: figures of two calls are read with their hosts.
    assert lines[1:5] == [
        "  revision abc1234",
        "  model name\t: AMD EPYC",
        "  cpus 16",
        "  python loop of 3M: 310 ms",
    ]
    assert "| c=768 | 50.0 | 75.0 | 50/60 | 656/4790 | 412 |" in lines
    assert "| c=1024 | 50.0 | 75.0 | -/- | -/- | - |" in lines  # the then/ sweep, no numbers
    assert lines.index("== http1/then") > lines.index("| c=768 | 50.0 | 75.0 | 50/60 | 656/4790 | 412 |")
    # Alike messages group, digits folded; the commonest first.
    assert "  768: 2 x '429: every talker is at capacity (N ready)', end to end p50 0.06 s" in lines
    assert "  768: 1 x '503: code2wav replica c2w-N stalled for N s', end to end p50 2.50 s" in lines
    assert any(line.startswith("  768: idle refusal probe {") for line in lines)
    # Refusals of the opening burst (sent within 1 s of the level's first request) apart.
    assert (
        "  768: refusals sent in the first 1 s 1, p50 / p95 40 / 40 ms; later 1, p50 / p95 60 / 60 ms"
        in lines
    )
    talker = lines[lines.index("talker:") + 1 :]
    assert talker[0] == (
        "  event-loop lag p50 <= 0 ms, p99 <= 25 ms over 100 samples; worst since the last scrape 300 ms"
    )
    assert "  underruns 7" in talker
    assert "  refused by admission 12, of them 5 at once by the front (the engine's last room)" in talker
    assert talker[2] == (
        "  admission capacity p5/p50/p95 <= 512/640/1024 streams over 100 steps, 4 with more running; "
        "room sent to gateways p5/p50/p95 <= 0/256/256 over 100 messages, 6 with none; rooms worked out "
        "in 20.9 ms on average (p95 <= 250 ms), the gateway's calls seen meanwhile 4.0 on average "
        "(p95 <= 64); last costs: step 4.70 ms + 20.0 us a stream, prefill 4.0 ms a request, decoder 27.0 us a frame"
    )
    assert (
        talker[3]
        == "  first chunks asked (frames, why): default counts 30, 2 counts 500, 4 counts 9, 4 timing 70"
    )
    assert talker[4] == "  smaller starts turned down (frames, bound): 1 ramp 5, 2 trip 60"
    assert "  calls waited before their handler: mean 402 ms, p95 <= 2500 ms over 3 calls" in talker
    assert "  stage prefill: n=2, mean 15.0 ms" in talker
    assert "  talker_chunk_hop_seconds means (ms): code2wav 1000.0" in talker
    assert (
        "  code2wav hop in transit (not held by code2wav): mean 30.0 ms, p95 <= 50 ms over 2 chunks" in talker
    )
    assert (
        "  of it queued on the talker (read off the call to the stream's task): mean 8.0 ms, p95 <= 25 ms"
        " over 2 chunks"
    ) in talker
    assert (
        "  session writes (oldest queued to written), means: DecodeSession 3.0 ms over 2, Session 10.0 ms over 1"
    ) in talker
    code2wav = lines[lines.index("code2wav:") + 1 :]
    assert "  stage open_stream: n=1, mean 500.0 ms" in code2wav
    # Its decode calls and the cost it publishes to the talker (an open loop's small calls).
    assert (
        "  decode calls: 2, mean 6.0 ms, 6.0 streams, 32.0 frames; published cost 1.50 ms a call + 90.0 us a frame"
    ) in code2wav
    assert (
        "  chunks waited for a decode call, means: first chunks 30.0 ms over 1, first chunks for their "
        "decoder state 12.0 ms over 1, all chunks 20.0 ms over 3"
    ) in code2wav
    assert "  session messages read to their stream: mean 4.0 ms, p95 <= 10 ms over 2" in code2wav
    assert "  decoder states after a reference prefix: 9 copied, 2 decoded" in code2wav
    # The start-up first, "serving" (process start to SERVING) ahead of its phases.
    assert code2wav[0] == (
        "  start-up: serving 159.4 s, load the decoder and capture its graphs 151.2 s, warm up 2.0 s"
    )


def test_bucket_quantile_takes_the_bucket_that_holds_it():
    buckets = [(0.001, 50.0), (0.01, 90.0), (0.1, 99.0), (float("inf"), 100.0)]
    assert bucket_quantile(buckets, 0.5) == 0.001
    assert bucket_quantile(buckets, 0.9) == 0.01
    assert bucket_quantile(buckets, 0.99) == 0.1
    assert bucket_quantile(buckets, 1.0) is None  # past the last finite bound
    assert bucket_quantile([], 0.5) is None
    assert bucket_quantile([(float("inf"), 0.0)], 0.5) is None


def test_the_command_prints_it_and_refuses_a_missing_folder(tmp_path, capsys):
    assert main([str(write_run(tmp_path))]) == 0
    assert "| c=768 |" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 0
    assert capsys.readouterr().out.startswith("no results.json or metrics-*.txt below")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    assert "no such folder" in capsys.readouterr().err


def test_first_audio_is_split_by_the_first_chunk_each_stream_got():
    """A stream's first chunk in frames is its share of the bytes times its audio, 80 ms a frame:
    here 1 frame of 10, 2 of 10 and 4 of 20 (16-bit PCM at 24 kHz: 3,840 bytes a frame)."""

    def stream(first_frames: int, frames: int, ttfa_s: float, ok: bool = True) -> dict:
        rest = [3840] * (frames - first_frames)
        return {
            "ok": ok,
            "ttfa_s": ttfa_s,
            "audio_s": frames * 0.08,
            "chunk_bytes": [3840 * first_frames, *rest],
        }

    records = [stream(1, 10, 0.04), stream(2, 10, 0.1), stream(2, 10, 0.12), stream(4, 20, 0.2)]
    records += [stream(8, 20, 5.0, ok=False), {"ok": True, "ttfa_s": 0.3, "audio_s": 0.0, "chunk_bytes": []}]
    assert first_chunk_split(records) == (
        "first audio by first chunk (frames: streams, p50 / p95): 1: 1, p50 / p95 40 / 40 ms; "
        "2: 2, p50 / p95 110 / 119 ms; 4: 1, p50 / p95 200 / 200 ms"
    )
    assert first_chunk_split([{"ok": False, "status": "429", "chunk_bytes": []}]) is None


def test_the_client_s_own_loop_lag_is_printed_beside_its_level():
    level = {
        "mode": "closed",
        "concurrency": 768,
        "records": [],
        "client_loop_lag_ms": {"p50": 1.25, "p99": 310.0, "max": 512.4, "samples": 900},
    }
    lines = failure_lines({"levels": [level]})
    assert "  768: the client's own event loop woke late by p50 / p99 / max 1.2 / 310.0 / 512 ms" in lines
    assert not any(
        "event loop" in line for line in failure_lines({"levels": [{**level, "client_loop_lag_ms": None}]})
    )


def test_the_talker_s_steps_and_the_wait_from_admission_to_prefill_are_summarised():
    from prometheus_client import CollectorRegistry, generate_latest

    from benchmarks.stack_summary import ScrapedMetrics, step_lines

    registry = CollectorRegistry()
    talker = TalkerMetrics(registry)
    for seconds in (0.010, 0.012):
        talker.step_seconds.observe(seconds)
    talker.prefill_seconds.observe(0.016)
    for seconds in (0.0, 0.030, 0.070, 0.090):  # one prompt at once, three waited for company
        talker.prefill_wait_seconds.observe(seconds)
    assert step_lines(ScrapedMetrics(generate_latest(registry).decode())) == [
        "  talker steps: 2 steps, mean 11.0 ms; 1 with a prefill, mean 16.0 ms; "
        "admission to prefill mean 47.5 ms, p50 / p90 <= 30 / 100 ms"
    ]
    assert step_lines(ScrapedMetrics("")) == []


def test_a_closed_loop_s_opening_burst_is_read_against_how_soon_it_started():
    """The first `concurrency` requests (every client's first): sent over how long, how many let
    in, and a lower bound on the queue's drain (all let in started within the send span plus the
    latest first audio); nothing for an open loop or a level without its whole opening."""
    records = [
        {"start_s": 10.0, "ok": True, "ttfa_s": 0.1},
        {"start_s": 10.1, "ok": True, "ttfa_s": 0.2},
        {"start_s": 10.2, "ok": False, "status": "429"},
        {"start_s": 10.3, "ok": True, "ttfa_s": 0.5},
        {"start_s": 15.0, "ok": True, "ttfa_s": 0.05},  # a later round's: not the opening's
    ]
    assert opening_split(records, 4) == (
        "opening: the first 4 requests sent over 0.30 s, 3 let in, their first audio p95 / max "
        "470 / 500 ms (the queue drained >= 4 a second)"
    )
    assert opening_split(records[:2], 2) == (
        "opening: the first 2 requests sent over 0.10 s, 2 let in, their first audio p95 / max 195 / 200 ms"
    )
    assert opening_split(records, 0) is None
    assert opening_split(records[:3], 4) is None
    level = {"mode": "closed", "concurrency": 4, "records": records}
    assert "  4: opening: the first 4 requests" in "\n".join(failure_lines({"levels": [level]}))


def test_each_gateway_s_requests_by_their_end(tmp_path):
    """With several gateways, whose share of the talker's room ran out shows per gateway."""
    from qtts.serving.metrics import GatewayMetrics

    run = tmp_path / "http1"
    run.mkdir()
    for name, refused in (("gateway", 0), ("gateway-1", 164)):
        gw = GatewayMetrics(CollectorRegistry())
        gw.requests_total.labels("http", "ok").inc(360)
        if refused:
            gw.requests_total.labels("http", "resource_exhausted").inc(refused)
        (run / f"metrics-{name}.txt").write_bytes(generate_latest(gw.registry))
    lines = summary([tmp_path]).splitlines()
    assert lines[lines.index("gateway:") + 1 :][:3].count("  requests by end: http ok 360") == 1
    after = lines[lines.index("gateway-1:") + 1 :]
    assert "  requests by end: http ok 360, http resource_exhausted 164" in after


def test_a_gateway_s_waits_for_a_spent_room_share(tmp_path):
    from qtts.serving.metrics import GatewayMetrics

    run = tmp_path / "http1"
    run.mkdir()
    gw = GatewayMetrics(CollectorRegistry())
    for seconds in (0.01, 0.03):
        gw.room_wait_seconds.labels("room").observe(seconds)
    gw.room_wait_seconds.labels("refused").observe(0.04)
    (run / "metrics-gateway.txt").write_bytes(generate_latest(gw.registry))
    lines = summary([tmp_path]).splitlines()
    assert "  waits for a spent room share: 2 got room, mean 20.0 ms, 1 refused, mean 40.0 ms" in lines


def test_the_talker_s_late_chunks_are_grouped_by_their_end_with_their_hops(tmp_path):
    """The talker logs each chunk handed on after its listener ran dry, hop by hop; the summary
    groups them by the frame their chunk ended at (the commonest first), and splits code2wav's
    hop where the line says how long code2wav held the chunk."""
    run = tmp_path / "http1"
    (run / "logs").mkdir(parents=True)
    (run / "metrics-talker.txt").write_bytes(generate_latest(TalkerMetrics(CollectorRegistry()).registry))
    prefix = "2026-12-07 11:15:42,075 INFO services.talker.chunk_hops [req-{0}]: request req-{0}: "
    lines = [
        prefix.format("a")
        + "audio up to frame 8 handed on 60 ms late; generate -20 ms, engine_to_loop 40 ms, "
        "to_code2wav 0 ms, code2wav 380 ms (held there 30 ms, in transit 350 ms), to_gateway 0 ms",
        prefix.format("b")
        + "audio up to frame 8 handed on 80 ms late; generate -40 ms, engine_to_loop 50 ms, "
        "to_code2wav 0 ms, code2wav 400 ms (held there 50 ms, in transit 350 ms, queued here 20 ms), to_gateway 2 ms",
        prefix.format("c")
        + "audio up to frame 16 handed on 5 ms late; generate 300 ms, engine_to_loop 1 ms, "
        "to_code2wav 0 ms, code2wav 90 ms, to_gateway 0 ms",
        "2026-12-07 11:15:42,076 INFO services.talker.server: something else",
    ]
    (run / "logs" / "talker.log").write_text("\n".join(lines) + "\n")
    out = summary([tmp_path]).splitlines()
    at = out.index("  late chunks logged: 3")
    assert out[at + 1] == (
        "    ending at frame 8: 2, late p50 80 ms; hop means (ms): generate -30, engine_to_loop 45, "
        "to_code2wav 0, code2wav 390, held there 40, in transit 350, to_gateway 1, queued here 20"
    )
    assert out[at + 2] == (
        "    ending at frame 16: 1, late p50 5 ms; hop means (ms): generate 300, engine_to_loop 1, "
        "to_code2wav 0, code2wav 90, to_gateway 0"
    )


def test_a_service_s_stalls_are_counted_with_where_its_loop_was(tmp_path):
    """A service that logged its loop thread's stack on a stall (TTS_STALL_DUMP_MS): the summary
    counts the stalls, says the longest, and groups the innermost two frames; a logged exception's
    traceback is not taken for a stall's stack."""
    run = tmp_path / "http1"
    (run / "logs").mkdir(parents=True)
    (run / "metrics-talker.txt").write_bytes(generate_latest(TalkerMetrics(CollectorRegistry()).registry))
    stack = [
        '  File "/usr/lib/python3.12/asyncio/base_events.py", line 641, in run_forever',
        "    self._run_once()",
        '  File "/usr/lib/python3.12/logging/__init__.py", line 1028, in handle',
        "    self.emit(record)",
        '  File "/app/qtts/serving/log_context.py", line 71, in emit',
        "    stream.write(msg)",
    ]
    prefix = "2026-12-07 19:50:33,{} WARNING qtts.serving.loop_lag: "
    lines = [
        prefix.format("700") + "the event loop is 201 ms late; its thread's stack (1 of at most 20):",
        *stack,
        prefix.format("900") + "the event loop stalled 412 ms (its stack is logged above)",
        prefix.format("950") + "the event loop is 203 ms late; its thread's stack (2 of at most 20):",
        *stack,
        prefix.format("990") + "the event loop stalled 650 ms (its stack is logged above)",
        "Traceback (most recent call last):",
        '  File "/app/services/talker/core.py", line 10, in generate',
        "ValueError: not a stall",
    ]
    (run / "logs" / "talker.log").write_text("\n".join(lines) + "\n")
    (run / "logs" / "gateway.log").write_text("nothing stalled here\n")
    out = summary([tmp_path]).splitlines()
    at = out.index("talker (its log):")
    assert out[at + 1] == "  event-loop stalls with the loop's stack logged: 2, longest 650 ms"
    assert out[at + 2] == "    loop thread at emit (log_context.py:71) < handle (__init__.py:1028): 2"
    assert "gateway (its log):" not in out
