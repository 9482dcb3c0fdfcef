"""Consistent-hash ring: balanced, deterministic, and only ~1/N of keys move on membership change."""

from __future__ import annotations

from collections import Counter

import pytest

from qtts.streams.hash_ring import HashRing
from qtts.streams.voice_key import voice_prompt_key

NODES = [f"10.0.0.{i}:50053" for i in range(1, 5)]
KEYS = [f"req-{i}" for i in range(20_000)]


def owners(ring: HashRing) -> dict[str, str]:
    return {k: ring.get(k) for k in KEYS}


def test_keys_spread_evenly_over_replicas():
    counts = Counter(owners(HashRing(NODES)).values())
    assert set(counts) == set(NODES)
    share = len(KEYS) / len(NODES)
    for node, n in counts.items():
        assert 0.75 * share < n < 1.25 * share, (node, n)


def test_a_key_always_maps_to_the_same_replica():
    a, b = HashRing(NODES), HashRing(reversed(NODES))
    for k in KEYS[:2000]:
        assert a.get(k) == a.get(k) == b.get(k)


def test_adding_a_replica_moves_only_about_one_nth_of_keys_all_to_it():
    before = owners(HashRing(NODES))
    ring = HashRing(NODES)
    ring.add("10.0.0.5:50053")
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "10.0.0.5:50053" for k in moved)
    assert 0.12 < len(moved) / len(KEYS) < 0.28  # ideal 1/5


def test_removing_a_replica_moves_only_its_keys():
    ring = HashRing(NODES)
    before = owners(ring)
    ring.remove(NODES[0])
    after = owners(ring)
    for k in KEYS:
        if before[k] != NODES[0]:
            assert after[k] == before[k]
        else:
            assert after[k] != NODES[0]
    ring.add(NODES[0])
    assert owners(ring) == before


def test_empty_ring_and_idempotent_membership():
    ring = HashRing()
    with pytest.raises(LookupError):
        ring.get("x")
    ring.add("a")
    ring.add("a")
    assert len(ring) == 1 and ring.get("x") == "a"
    ring.remove("missing")
    assert ring.nodes == {"a"}
    with pytest.raises(ValueError):
        HashRing(vnodes=0)


def test_voice_prompt_key_depends_on_every_part():
    pcm = b"\x00\x00\x80\x3f" * 10
    base = voice_prompt_key("m", pcm, "hello", False)
    assert base == voice_prompt_key("m", pcm, "hello", False)
    assert (
        len(
            {
                base,
                voice_prompt_key("m2", pcm, "hello", False),
                voice_prompt_key("m", pcm + b"\x00\x00\x00\x00", "hello", False),
                voice_prompt_key("m", pcm, "hello!", False),
                voice_prompt_key("m", pcm, "hello", True),
            }
        )
        == 5
    )
    # The transcript does not enter an x-vector-only prompt, so it does not change its key.
    assert voice_prompt_key("m", pcm, "a", True) == voice_prompt_key("m", pcm, None, True)
