"""The gateway's talker pool: re-resolution, least-streams placement, in-flight streams never move.

Pure units with a fake resolver, fake channels and a fake health probe, then two real gRPC talker
servers (fake servicers) behind a resolver whose answer changes at run time.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from qtts.request.errors import Unavailable
from services.gateway.talker_pool import DnsResolver, StaticResolver, TalkerPool, split_target


class FakeChannel:
    def __init__(self, address: str):
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class Fakes:
    """A resolver, channel factory and probe whose answers the test sets."""

    def __init__(self, *addresses: str):
        self.addresses = list(addresses)
        self.down: set[str] = set()
        self.slow: set[str] = set()
        self.fail_resolution = False
        self.channels: list[FakeChannel] = []

    async def resolve(self) -> list[str]:
        if self.fail_resolution:
            raise OSError("Temporary failure in name resolution")
        return list(self.addresses)

    def connect(self, address: str) -> FakeChannel:
        channel = FakeChannel(address)
        self.channels.append(channel)
        return channel

    async def probe(self, channel: FakeChannel) -> bool | None:
        if channel.address in self.slow:
            return None  # no answer within the probe's deadline
        return channel.address not in self.down

    def pool(self) -> TalkerPool:
        return TalkerPool(self, connect=self.connect, probe=self.probe, min_refresh_gap_s=0.0)

    def opened(self, address: str) -> int:
        return sum(c.address == address for c in self.channels)


async def settle() -> None:
    """Let the channel closes the pool scheduled run."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_streams_spread_evenly_and_equal_talkers_take_turns():
    fakes = Fakes("a:1", "b:1", "c:1")
    pool = fakes.pool()
    await pool.refresh()
    leases = [await pool.acquire() for _ in range(6)]
    assert Counter(lease.address for lease in leases) == {"a:1": 2, "b:1": 2, "c:1": 2}
    for lease in leases:
        lease.release()
    # Idle pool: one stream at a time goes round robin.
    order = []
    for _ in range(6):
        with await pool.acquire() as lease:
            order.append(lease.address)
    assert sorted(order[:3]) == ["a:1", "b:1", "c:1"] and order[3:] == order[:3]


async def test_new_streams_go_to_the_least_loaded_talker():
    fakes = Fakes("a:1", "b:1")
    pool = fakes.pool()
    await pool.refresh()
    held = [await pool.acquire() for _ in range(4)]
    for lease in [x for x in held if x.address == "a:1"]:
        lease.release()
    assert {(await pool.acquire()).address for _ in range(2)} == {"a:1"}


async def test_a_talker_added_at_run_time_takes_new_streams_and_old_ones_stay():
    fakes = Fakes("a:1")
    pool = fakes.pool()
    await pool.refresh()
    old = [await pool.acquire() for _ in range(3)]
    fakes.addresses.append("b:1")
    await pool.refresh()
    new = [await pool.acquire() for _ in range(3)]
    assert [lease.address for lease in new] == ["b:1"] * 3
    assert [lease.address for lease in old] == ["a:1"] * 3
    assert {a: e.active for a, e in pool.endpoints.items()} == {"a:1": 3, "b:1": 3}
    assert Counter([(await pool.acquire()).address for _ in range(2)]) == {"a:1": 1, "b:1": 1}


async def test_a_removed_talker_keeps_its_streams_until_they_end_then_its_channel_closes():
    fakes = Fakes("a:1", "b:1")
    pool = fakes.pool()
    await pool.refresh()
    on_a = [lease for lease in [await pool.acquire() for _ in range(4)] if lease.address == "a:1"]
    fakes.addresses = ["b:1"]
    await pool.refresh()
    assert {(await pool.acquire()).address for _ in range(4)} == {"b:1"}
    a = pool.endpoints["a:1"]
    assert a.retired and a.active == 2 and not a.channel.closed
    on_a[0].release()
    on_a[0].release()  # a second release is a no-op
    assert pool.endpoints["a:1"].active == 1
    on_a[1].release()
    await settle()
    assert "a:1" not in pool.endpoints and a.channel.closed


async def test_a_flapping_talker_reuses_its_channel_while_streams_run_and_reconnects_after():
    fakes = Fakes("a:1", "b:1")
    pool = fakes.pool()
    await pool.refresh()
    lease = next(x for x in [await pool.acquire() for _ in range(2)] if x.address == "a:1")
    for _ in range(3):
        fakes.addresses = ["b:1"]
        await pool.refresh()
        assert "a:1" not in {e.address for e in pool.usable()}
        fakes.addresses = ["a:1", "b:1"]
        await pool.refresh()
        assert "a:1" in {e.address for e in pool.usable()}
    assert fakes.opened("a:1") == 1 and pool.endpoints["a:1"] is lease.endpoint
    lease.release()
    fakes.addresses = ["b:1"]
    await pool.refresh()
    await settle()
    assert lease.endpoint.channel.closed
    fakes.addresses = ["a:1", "b:1"]
    await pool.refresh()
    assert fakes.opened("a:1") == 2 and not pool.endpoints["a:1"].channel.closed


async def test_talkers_that_are_not_serving_get_no_new_streams():
    fakes = Fakes("a:1", "b:1")
    fakes.down = {"a:1"}
    pool = fakes.pool()
    await pool.refresh()
    assert {(await pool.acquire()).address for _ in range(3)} == {"b:1"}
    # A call that failed as unreachable takes the talker out until a probe sees it SERVING.
    lease = await pool.acquire()
    lease.mark_unavailable()
    lease.release()
    fakes.down = set()
    assert [e.address for e in pool.usable()] == []
    assert (await pool.acquire()).address in {"a:1", "b:1"}  # acquire refreshed: both serve again
    assert [e.address for e in pool.usable()] == ["a:1", "b:1"]


async def test_one_slow_probe_keeps_a_ready_talker_two_take_it_out():
    fakes = Fakes("a:1")
    pool = fakes.pool()
    await pool.refresh()
    fakes.slow = {"a:1"}
    await pool.refresh()  # one probe without an answer in time: still ready
    assert [e.address for e in pool.usable()] == ["a:1"]
    await pool.refresh()  # the second in a row: out
    assert pool.usable() == []
    fakes.slow = set()
    await pool.refresh()
    assert [e.address for e in pool.usable()] == ["a:1"]
    # A talker that answers NOT_SERVING (or cannot be reached) is out at once.
    fakes.down = {"a:1"}
    await pool.refresh()
    assert pool.usable() == []
    # A talker that never answered in time is not ready: slowness keeps only a ready one.
    fresh = Fakes("b:1")
    fresh.slow = {"b:1"}
    other = fresh.pool()
    await other.refresh()
    assert other.usable() == []


async def test_wait_usable_returns_once_a_talker_serves():
    fakes = Fakes("a:1")
    fakes.down = {"a:1"}
    pool = fakes.pool()
    waiting = asyncio.ensure_future(pool.wait_usable(retry_s=0.01))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    fakes.down = set()
    await asyncio.wait_for(waiting, 2.0)
    assert [e.address for e in pool.usable()] == ["a:1"]


async def test_a_failed_or_empty_resolution_keeps_the_known_talkers():
    fakes = Fakes("a:1", "b:1")
    pool = fakes.pool()
    await pool.refresh()
    fakes.fail_resolution = True
    await pool.refresh()
    assert [e.address for e in pool.usable()] == ["a:1", "b:1"]
    fakes.fail_resolution = False
    fakes.addresses = []
    await pool.refresh()
    assert [e.address for e in pool.usable()] == ["a:1", "b:1"]
    # ... but their health still decides: all down means no stream.
    fakes.down = {"a:1", "b:1"}
    await pool.refresh()
    with pytest.raises(Unavailable):
        await pool.acquire()


async def test_acquire_on_an_empty_pool_resolves_first():
    fakes = Fakes("a:1")
    pool = fakes.pool()
    assert (await pool.acquire()).address == "a:1"
    fakes.down = {"a:1"}
    await pool.refresh()
    with pytest.raises(Unavailable, match="no talker is ready"):
        await pool.acquire()


async def test_close_closes_every_channel_and_stops_refreshing():
    fakes = Fakes("a:1", "b:1")
    pool = TalkerPool(fakes, connect=fakes.connect, probe=fakes.probe, refresh_s=0.01)
    pool.start()
    for _ in range(100):
        if len(pool.usable()) == 2:
            break
        await asyncio.sleep(0.01)
    fakes.addresses.append("c:1")
    for _ in range(100):
        if len(pool.usable()) == 3:
            break
        await asyncio.sleep(0.01)
    assert len(pool.usable()) == 3
    await pool.close()
    assert all(c.closed for c in fakes.channels) and pool.endpoints == {}


@pytest.mark.parametrize(
    "target, expected",
    [
        ("dns:///talker.voice.svc.cluster.local:50052", ("talker.voice.svc.cluster.local", 50052)),
        ("dns://10.0.0.10:53/talker:50052", ("talker", 50052)),
        ("dns:talker:50052", ("talker", 50052)),
        ("ipv4:10.1.2.3:50052", ("10.1.2.3", 50052)),
        ("127.0.0.1:50052", ("127.0.0.1", 50052)),
        ("[::1]:50052", ("::1", 50052)),
    ],
)
def test_split_target(target, expected):
    assert split_target(target) == expected


@pytest.mark.parametrize("bad", ["talker", "dns:///talker", "talker:port"])
def test_split_target_rejects_a_target_without_port(bad):
    with pytest.raises(ValueError):
        split_target(bad)


async def test_dns_resolver_returns_each_address_once():
    assert await DnsResolver("dns:///127.0.0.1:50052").resolve() == ["127.0.0.1:50052"]
    assert await StaticResolver(["x:1"]).resolve() == ["x:1"]
