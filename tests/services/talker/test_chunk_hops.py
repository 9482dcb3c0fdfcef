"""The talker's per-chunk timing feeds the start planner the trips of a stream's early chunks only."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from qtts.serving.metrics import TalkerMetrics
from qtts.streams.chunk_plan import StartPlanner
from services.talker.chunk_hops import ChunkHops
from services.talker.config import config_from_args


def test_only_a_stream_s_first_chunks_trips_reach_the_start_planner():
    trips: list[float] = []
    _six_chunks(ChunkHops("r", on_code2wav_hop=trips.append, early_chunks=3))
    assert [round(t, 2) for t in trips] == [0.01, 0.02, 0.03]
    every: list[float] = []
    _six_chunks(ChunkHops("r", on_code2wav_hop=every.append, early_chunks=0))  # 0: every chunk
    assert [round(t, 2) for t in every] == [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]


def _six_chunks(hops: ChunkHops) -> None:
    """Six chunks of two frames through `hops`, each trip through code2wav 10 ms longer."""
    hops.submitted()
    for k, end in enumerate(range(2, 14, 2)):
        hops.made(end, time.perf_counter())
        hops.sent(end)
        arrived = time.perf_counter() + 0.01 * (k + 1)
        if k == 0:
            hops.first_chunk(end, arrived, arrived)
        else:
            hops.chunk(end, arrived, arrived, slack_s=1.0)


def test_the_trips_the_planner_hears_are_a_talker_flag():
    assert config_from_args([]).start_plan_trip_chunks == StartPlanner.TRIP_CHUNKS == 3
    assert config_from_args(["--start-plan-trip-chunks", "0"]).start_plan_trip_chunks == 0
    planner = config_from_args(
        ["--start-plan-trip-chunks", "5", "--start-plan-busy-streams", "9"]
    ).start_planner()
    assert (planner.trip_chunks, planner.policy.busy_streams) == (5, 9)  # what the server's core gets
    with pytest.raises(SystemExit):
        config_from_args(["--start-plan-trip-chunks", "-1"])
    with pytest.raises(ValueError):
        StartPlanner(trip_chunks=-1)


def test_a_chunk_without_its_send_time_feeds_nothing():
    trips: list[float] = []
    hops = ChunkHops("r", on_code2wav_hop=trips.append)
    hops.submitted()
    hops.made(2, time.perf_counter())  # never sent
    hops.first_chunk(2, time.perf_counter(), time.perf_counter())
    assert trips == []


def test_frames_handed_on_one_by_one_keep_no_timing_past_their_chunk():
    """A text-fed stream's frames come one at a time: the ones inside a chunk end no chunk, and
    are let go when the chunk is sent, so a long stream holds no timing per frame; the chunk's
    own end is still timed."""
    trips: list[float] = []
    hops = ChunkHops("r", on_code2wav_hop=trips.append)
    hops.submitted()
    for chunk_end in range(4, 404, 4):
        for frame in range(chunk_end - 3, chunk_end + 1):
            hops.made(frame, time.perf_counter())
        hops.sent(chunk_end)
        arrived = time.perf_counter()
        if chunk_end == 4:
            hops.first_chunk(chunk_end, arrived, arrived)
        else:
            hops.chunk(chunk_end, arrived, arrived, slack_s=1.0)
    assert hops._made_at == {} and hops._sent_at == {}
    assert len(trips) == 100  # every chunk's trip timed (early_chunks 0: all of them)


def test_a_chunk_sent_before_the_audio_of_the_one_before_it_keeps_that_one_timed():
    """Chunks go out before the audio of the ones before them comes back: sending the second
    chunk keeps the first one's timing, so the first chunk is still timed when its audio comes."""
    trips: list[float] = []
    hops = ChunkHops("r", on_code2wav_hop=trips.append)
    hops.submitted()
    hops.made(2, time.perf_counter())
    hops.sent(2)
    hops.made(3, time.perf_counter())  # a frame inside the next chunk
    hops.made(6, time.perf_counter())
    hops.sent(6)
    arrived = time.perf_counter()
    hops.first_chunk(2, arrived, arrived)
    hops.chunk(6, arrived, arrived, slack_s=1.0)
    assert len(trips) == 2 and hops._made_at == {} and hops._sent_at == {}


def test_a_late_chunk_s_code2wav_hop_is_split_into_what_code2wav_held_and_transit(caplog):
    """code2wav reports how long it held each chunk (its wait for a decode call and the call):
    the rest of the hop is transit, observed for every chunk, and a late chunk's log line says
    both. A replica that does not report it (0) leaves the hop whole."""
    metrics = TalkerMetrics(CollectorRegistry())
    hops = ChunkHops("r", metrics=metrics)
    hops.submitted()
    hops.made(2, time.perf_counter())
    hops.sent(2)
    sent = time.perf_counter()
    hops.first_chunk(2, sent + 0.05, sent + 0.05, held_s=0.01)
    hops.made(4, time.perf_counter())
    hops.sent(4)
    sent = time.perf_counter()
    with caplog.at_level("INFO", logger="services.talker.chunk_hops"):
        hops.chunk(4, sent + 0.3, sent + 0.3, slack_s=-0.02, held_s=0.1)
    transit = metrics.registry.get_sample_value("tts_talker_code2wav_transit_seconds_sum")
    assert metrics.registry.get_sample_value("tts_talker_code2wav_transit_seconds_count") == 2
    assert transit == pytest.approx(0.04 + 0.2, abs=0.005)
    (line,) = [r.getMessage() for r in caplog.records if "late" in r.getMessage()]
    assert "handed on 20 ms late" in line
    assert "code2wav 300 ms (held there 100 ms, in transit 200 ms)" in line
    hops.made(6, time.perf_counter())
    hops.sent(6)
    sent = time.perf_counter()
    hops.chunk(6, sent + 0.05, sent + 0.05, slack_s=0.5)  # not said: no transit
    assert metrics.registry.get_sample_value("tts_talker_code2wav_transit_seconds_count") == 2


def test_the_audio_s_wait_on_the_talker_is_split_out_of_the_transit(caplog):
    """The audio's message is stamped when the talker reads it off the code2wav call: from then
    to the stream's task taking it is the talker's own wait (its loop and queues), observed for
    every stamped chunk and said in a late chunk's log line; an unstamped chunk (0) observes none."""
    metrics = TalkerMetrics(CollectorRegistry())
    hops = ChunkHops("r", metrics=metrics)
    hops.submitted()
    hops.made(2, time.perf_counter())
    hops.sent(2)
    sent = time.perf_counter()
    hops.first_chunk(2, sent + 0.05, sent + 0.05, held_s=0.01, received_at=sent + 0.04)
    hops.made(4, time.perf_counter())
    hops.sent(4)
    sent = time.perf_counter()
    with caplog.at_level("INFO", logger="services.talker.chunk_hops"):
        hops.chunk(4, sent + 0.3, sent + 0.3, slack_s=-0.02, held_s=0.1, received_at=sent + 0.18)
    registry = metrics.registry
    assert registry.get_sample_value("tts_talker_code2wav_audio_queued_seconds_count") == 2
    queued = registry.get_sample_value("tts_talker_code2wav_audio_queued_seconds_sum")
    assert queued == pytest.approx(0.01 + 0.12, abs=0.002)
    (line,) = [r.getMessage() for r in caplog.records if "late" in r.getMessage()]
    assert "code2wav 300 ms (held there 100 ms, in transit 200 ms, queued here 120 ms)" in line
    hops.made(6, time.perf_counter())
    hops.sent(6)
    sent = time.perf_counter()
    hops.chunk(6, sent + 0.05, sent + 0.05, slack_s=0.5, held_s=0.01)  # not stamped
    assert registry.get_sample_value("tts_talker_code2wav_audio_queued_seconds_count") == 2
