"""Two code2wav replicas: requests spread over both, and each stream is decoded by one replica."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_helpers import FRAME, REF_B64, scrape, wav_frames

pytestmark = pytest.mark.e2e

REQUESTS = 16  # with 2 replicas, all on one replica by chance has probability 2^-15


def _replicas(stack):
    return [p for p in stack.processes if p.name.startswith("code2wav")]


def _frames_by_replica(stack) -> dict[str, float]:
    return {
        p.name: scrape(p.spec.metrics_port).get("tts_code2wav_frames_total", 0.0) for p in _replicas(stack)
    }


def _replica_name(stack, reported: str) -> str:
    """The summary names the replica by its name or its address."""
    for p in _replicas(stack):
        if reported in (p.name, p.spec.grpc_address) or reported.endswith(p.spec.grpc_address):
            return p.name
    raise AssertionError(f"unknown replica {reported!r}")


def test_streams_spread_over_replicas_and_stay_on_one(stack):
    before = _frames_by_replica(stack)

    def one(i: int) -> tuple[str, int]:
        body = {
            "input": f"Request number {i}.",
            "voice": "v",
            "ref_audio": REF_B64,
            "x_vector_only_mode": True,
            "max_new_tokens": 4,
            "seed": i,
            "response_format": "wav",
            "stream": False,
        }
        r = httpx.post(f"{stack.http_url}/v1/audio/speech", json=body, timeout=120)
        assert r.status_code == 200, r.text
        frames = int(r.headers["x-tts-num-frames"])
        assert wav_frames(r.content) == frames * FRAME
        return _replica_name(stack, r.headers["x-tts-code2wav-replica"]), frames

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(REQUESTS)))
    used = {name for name, _ in results}
    assert used == {p.name for p in _replicas(stack)}, results
    after = _frames_by_replica(stack)
    for name in used:
        # Every frame of a stream was decoded by the replica its summary names.
        assert after[name] - before[name] == sum(f for n, f in results if n == name), (name, results)
