"""A replica off the ring that serves again is found by the request that needs it, without waiting
for the periodic health check (the race that failed a benchmark's first levels with 503s: the
talker had marked code2wav down while it was still capturing graphs)."""

from __future__ import annotations

from unittest import mock

import pytest
from grpc_health.v1 import health_pb2

from qtts.request.errors import Unavailable
from services.talker import replicas as replicas_mod
from services.talker.replicas import Code2WavReplicas


class FakeHealth:
    def __init__(self, serving: bool):
        self.serving = serving
        self.calls = 0

    async def Check(self, request, timeout=None, wait_for_ready=None):  # noqa: N802 - gRPC method name
        self.calls += 1
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)


def _replicas(serving: bool):
    reps = Code2WavReplicas(["a:1"], channel_factory=lambda _: mock.MagicMock())
    health = FakeHealth(serving)
    reps._health = {"a:1": health}
    reps.mark_down("a:1", "health check failed: UNAVAILABLE")
    return reps, health


async def test_a_replica_back_up_is_probed_and_picked_at_once():
    reps, health = _replicas(serving=True)
    with pytest.raises(Unavailable):
        reps.pick("req-1")
    assert await reps.pick_or_probe("req-1") == "a:1"
    assert health.calls == 1
    assert reps.healthy == frozenset({"a:1"})
    assert await reps.pick_or_probe("req-2") == "a:1"  # on the ring again: no further probe
    assert health.calls == 1


async def test_an_outage_fails_fast_and_probes_at_most_once_per_interval(monkeypatch):
    reps, health = _replicas(serving=False)
    with pytest.raises(Unavailable, match="no code2wav replica is available"):
        await reps.pick_or_probe("req-1")
    with pytest.raises(Unavailable):
        await reps.pick_or_probe("req-2")
    assert health.calls == 1  # the second request came within PROBE_INTERVAL_S
    monkeypatch.setattr(replicas_mod, "PROBE_INTERVAL_S", 0.0)
    with pytest.raises(Unavailable):
        await reps.pick_or_probe("req-3")
    assert health.calls == 2


async def test_excluded_replicas_are_not_probed():
    reps, health = _replicas(serving=True)
    with pytest.raises(Unavailable):
        await reps.pick_or_probe("req-1", exclude=frozenset({"a:1"}))
    assert health.calls == 0
