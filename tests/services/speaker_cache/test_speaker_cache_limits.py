"""speaker_cache limits with a real redis-server: --max-voices holds with Redis, also for several
replicas racing on one Redis; refusals name no internal address."""

from __future__ import annotations

import asyncio

import pytest

from qtts.request.errors import AlreadyExists, ResourceExhausted
from services.speaker_cache.redis_store import RedisStore
from tests.services.speaker_cache.test_speaker_cache import _voice, redis_url  # noqa: F401 - the fixture


async def test_max_voices_holds_with_redis_even_for_racing_replicas(redis_url):  # noqa: F811
    replicas = [RedisStore(redis_url, max_voices=3) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(replicas[i % 3].create_voice(_voice(f"v{i}"), overwrite=False) for i in range(6)),
            return_exceptions=True,
        )
        assert sum(not isinstance(r, BaseException) for r in results) == 3
        assert all(isinstance(r, ResourceExhausted) for r in results if isinstance(r, BaseException))
        assert await replicas[0].count_voices() == 3
        stored = sorted(v.name for v in await replicas[0].list_voices())
        # At the limit: an existing voice may still be replaced, a new name may not come in.
        await replicas[1].create_voice(_voice(stored[0], samples=10), overwrite=True)
        with pytest.raises(AlreadyExists):
            await replicas[1].create_voice(_voice(stored[0]), overwrite=False)
        with pytest.raises(ResourceExhausted) as info:
            await replicas[2].create_voice(_voice("late"), overwrite=True)
        assert "limit" in info.value.message
        await replicas[0].delete_voice(stored[1])
        await replicas[2].create_voice(_voice("late"), overwrite=False)
        assert await replicas[0].count_voices() == 3
    finally:
        for store in replicas:
            await store.close()
