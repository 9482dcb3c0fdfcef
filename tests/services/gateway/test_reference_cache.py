"""The gateway's decoded-reference cache: same bytes decode once, LRU within the byte budget,
failures not cached, read-only shared results, and the server wires it with its metrics."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gateway_fakes import fake_decode, free_port, wav_bytes

from qtts.request.errors import InvalidArgument
from services.gateway.config import GatewayConfig
from services.gateway.reference_cache import DecodedReferenceCache
from services.gateway.server import GatewayServer


class CountingDecode:
    def __init__(self, samples: int = 1000):
        self.calls: list[bytes] = []
        self.samples = samples

    def __call__(self, data: bytes) -> np.ndarray:
        self.calls.append(data)
        if data == b"bad":
            raise InvalidArgument("reference audio could not be decoded")
        return np.full(self.samples, len(data), dtype=np.float32)


def test_same_bytes_decode_once_and_share_a_read_only_result():
    decode = CountingDecode()
    hits, misses = [], []
    cache = DecodedReferenceCache(decode, 1 << 20, lambda: hits.append(1), lambda: misses.append(1))
    a = cache(b"clip-a")
    b = cache(b"clip-a")
    assert a is b and decode.calls == [b"clip-a"] and (len(hits), len(misses)) == (1, 1)
    assert np.array_equal(a, np.full(1000, 6, dtype=np.float32))
    with pytest.raises(ValueError):
        a[0] = 1.0  # shared between requests: nobody may modify it
    assert cache(b"clip-b") is not a and len(cache) == 2


def test_lru_eviction_within_the_byte_budget_and_oversized_results():
    decode = CountingDecode(samples=1000)  # 4000 bytes per entry
    cache = DecodedReferenceCache(decode, 8000)
    cache(b"a")
    cache(b"b")
    cache(b"a")  # a is now the most recent
    cache(b"c")  # evicts b
    assert cache.bytes_used == 8000 and len(cache) == 2
    cache(b"a")
    cache(b"b")
    assert decode.calls == [b"a", b"b", b"c", b"b"]
    big = DecodedReferenceCache(CountingDecode(samples=3000), 8000)
    big(b"x")
    big(b"x")
    assert len(big) == 0 and big.bytes_used == 0  # larger than the whole budget: never kept


def test_failures_are_not_cached_and_concurrent_use_is_consistent():
    decode = CountingDecode()
    cache = DecodedReferenceCache(decode, 1 << 20)
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            cache(b"bad")
    assert decode.calls == [b"bad", b"bad"] and len(cache) == 0
    results: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(cache(b"clip-%d" % (i % 4)))) for i in range(32)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 32 and len(cache) == 4 and cache.bytes_used == 4 * 4000


async def test_server_uses_the_cache_unless_disabled(monkeypatch):
    from services.gateway import http_body

    monkeypatch.setattr(http_body, "_decoded", http_body._decoded)  # restored after the test
    config = GatewayConfig(http_port=free_port(), grpc_port=free_port(), metrics_port=0).validate()
    server = GatewayServer(config, decode=fake_decode)
    assert server.reference_cache is not None and server.reference_cache.max_bytes == 256 << 20
    # The clips' base64 decodes are kept within a quarter of the same flag.
    assert http_body._decoded is not None and http_body._decoded.max_cost == 64 << 20
    # Synthesis decodes through the cache, also while it is still empty (and so falsy).
    assert server.synthesizer._decode is server.reference_cache
    clip = wav_bytes()
    server.reference_cache(clip)
    server.reference_cache(clip)
    assert server.metrics.reference_cache_hits._value.get() == 1
    assert server.metrics.reference_cache_misses._value.get() == 1
    # A hit is also answered without decoding (on the event loop); a miss is None.
    assert server.reference_cache.cached(clip) is not None
    assert server.reference_cache.cached(wav_bytes(seconds=0.5)) is None
    assert server.metrics.reference_cache_hits._value.get() == 2
    off = GatewayServer(
        GatewayConfig(
            http_port=free_port(), grpc_port=free_port(), metrics_port=0, ref_audio_cache_mb=0
        ).validate(),
        decode=fake_decode,
    )
    assert off.reference_cache is None and off.synthesizer._decode is fake_decode
    assert http_body._decoded is None
    with pytest.raises(InvalidArgument, match="--ref-audio-cache-mb"):
        GatewayConfig(ref_audio_cache_mb=-1).validate()
