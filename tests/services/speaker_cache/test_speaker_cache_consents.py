"""speaker_cache's voice consents: both stores (in-process and a real Redis), shared by replicas,
and the RPCs over gRPC."""

from __future__ import annotations

import grpc
import pytest

from qtts.pb import speaker_cache_pb2 as pb
from qtts.pb import speaker_cache_pb2_grpc
from qtts.request.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from services.speaker_cache.lru_store import LruStore
from services.speaker_cache.records import ConsentRecord
from services.speaker_cache.redis_store import RedisStore
from tests.services.speaker_cache.test_speaker_cache import _config, _start, redis_url, store_url  # noqa: F401 - fixtures


def consent(i: int, name: str = "Speaker") -> ConsentRecord:
    return ConsentRecord(f"cons_{i:04d}", name, "en-US", 1_700_000_000 + i, "ab" * 32, 1000 + i)


@pytest.fixture(params=["lru", "redis"])
async def store(request):
    if request.param == "lru":
        s = LruStore(max_voices=3)
    else:
        s = RedisStore(request.getfixturevalue("redis_url"), max_voices=3)
    try:
        yield s
    finally:
        await s.close()


async def test_consents_are_kept_in_creation_order_and_bounded(store):
    for i in (3, 1, 2):  # ids out of order: the order is the creation order
        assert await store.put_consent(consent(i), create=True) == consent(i)
    with pytest.raises(AlreadyExists):
        await store.put_consent(consent(1), create=True)
    with pytest.raises(ResourceExhausted):
        await store.put_consent(consent(4), create=True)
    page, more = await store.list_consents("", 2)
    assert [c.id for c in page] == ["cons_0003", "cons_0001"] and more
    page, more = await store.list_consents("cons_0001", 2)
    assert page == [consent(2)] and not more
    with pytest.raises(InvalidArgument):
        await store.list_consents("cons_9999", 2)
    renamed = consent(1, name="Renamed")
    await store.put_consent(renamed, create=False)
    assert await store.get_consent("cons_0001") == renamed
    assert [c.id for c in (await store.list_consents("", 10))[0]] == ["cons_0003", "cons_0001", "cons_0002"]
    with pytest.raises(NotFound):
        await store.put_consent(consent(7), create=False)
    await store.delete_consent("cons_0003")
    with pytest.raises(NotFound):
        await store.get_consent("cons_0003")
    with pytest.raises(NotFound):
        await store.delete_consent("cons_0003")
    await store.put_consent(consent(4), create=True)  # room again
    assert [c.id for c in (await store.list_consents("", 10))[0]] == ["cons_0001", "cons_0002", "cons_0004"]


async def test_replicas_sharing_a_redis_see_each_others_consents(redis_url):  # noqa: F811
    a, b = RedisStore(redis_url), RedisStore(redis_url)
    try:
        await a.put_consent(consent(1), create=True)
        assert await b.get_consent("cons_0001") == consent(1)
        await b.delete_consent("cons_0001")
        with pytest.raises(NotFound):
            await a.get_consent("cons_0001")
    finally:
        await a.close()
        await b.close()


async def test_consent_rpcs_over_grpc(store_url):  # noqa: F811
    server, channel = await _start(_config(store_url))
    try:
        stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel)
        record = pb.VoiceConsent(
            id="cons_abc", name="Me", language="en-US", recording_sha256="00", recording_bytes=5
        )
        made = (await stub.PutConsent(pb.PutConsentRequest(consent=record, create=True))).consent
        assert made.created_unix_s > 0 and made.name == "Me"  # stamped when the caller gave no time
        got = (await stub.GetConsent(pb.GetConsentRequest(id="cons_abc"))).consent
        assert got == made
        listed = await stub.ListConsents(pb.ListConsentsRequest(limit=10))
        assert list(listed.consents) == [made] and not listed.has_more
        for req, code in (
            (pb.PutConsentRequest(consent=record, create=True), grpc.StatusCode.ALREADY_EXISTS),
            (pb.PutConsentRequest(consent=pb.VoiceConsent(id="bad id!", name="x", language="en")), None),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PutConsent(req)
            assert err.value.code() == (code or grpc.StatusCode.INVALID_ARGUMENT)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListConsents(pb.ListConsentsRequest(limit=0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await stub.DeleteConsent(pb.DeleteConsentRequest(id="cons_abc"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetConsent(pb.GetConsentRequest(id="cons_abc"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await channel.close()
        await server.stop(0.5)
