"""The talker's per-chunk timing feeds the start planner the trips of a stream's early chunks only."""

from __future__ import annotations

import time

from services.talker.chunk_hops import ChunkHops


def test_only_a_stream_s_first_chunks_trips_reach_the_start_planner():
    trips: list[float] = []
    hops = ChunkHops("r", on_code2wav_hop=trips.append, early_chunks=3)
    hops.submitted()
    for k, end in enumerate(range(2, 14, 2)):  # six chunks of two frames
        now = time.perf_counter()
        hops.made(end, now)
        hops.sent(end)
        arrived = time.perf_counter() + 0.01 * (k + 1)  # each trip 10 ms longer than the last
        if k == 0:
            hops.first_chunk(end, arrived, arrived)
        else:
            hops.chunk(end, arrived, arrived, slack_s=1.0)
    assert len(trips) == 3
    assert [round(t, 2) for t in trips] == [0.01, 0.02, 0.03]


def test_a_chunk_without_its_send_time_feeds_nothing():
    trips: list[float] = []
    hops = ChunkHops("r", on_code2wav_hop=trips.append)
    hops.submitted()
    hops.made(2, time.perf_counter())  # never sent
    hops.first_chunk(2, time.perf_counter(), time.perf_counter())
    assert trips == []
