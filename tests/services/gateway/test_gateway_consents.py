"""/v1/audio/voice_consents through the official `openai` SDK, and voice uploads checked against it."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_fakes import build_gateway, serve_http, wav_bytes

from qtts.request.errors import InvalidArgument, NotFound, ResourceExhausted
from services.gateway.consents import ConsentStore


def _client(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


async def test_create_list_get_rename_delete_with_the_sdk():
    async with serve_http(build_gateway()) as gw:
        client = _client(gw)
        made = [
            await client.audio.voice_consents.create(
                name=f"Person {i}", language="en-US", recording=("c.wav", wav_bytes(), "audio/wav")
            )
            for i in range(3)
        ]
        assert all(c.id.startswith("cons_") and c.object == "audio.voice_consent" for c in made)
        assert made[0].name == "Person 0" and made[0].language == "en-US" and made[0].created_at > 0
        page = await client.audio.voice_consents.list(limit=2)
        assert [c.id for c in page.data] == [c.id for c in made[:2]] and page.has_more
        assert [c.id async for c in await client.audio.voice_consents.list(limit=2)] == [c.id for c in made]
        got = await client.audio.voice_consents.retrieve(made[1].id)
        assert got.id == made[1].id and got.name == "Person 1"
        renamed = await client.audio.voice_consents.update(made[1].id, name="Renamed")
        assert (
            renamed.name == "Renamed"
            and (await client.audio.voice_consents.retrieve(made[1].id)).name == "Renamed"
        )
        deleted = await client.audio.voice_consents.delete(made[1].id)
        assert (deleted.id, deleted.deleted, deleted.object) == (made[1].id, True, "audio.voice_consent")
        with pytest.raises(openai.NotFoundError):
            await client.audio.voice_consents.retrieve(made[1].id)
        await client.close()


async def test_a_voice_upload_names_an_existing_consent():
    async with serve_http(build_gateway()) as gw:
        client = _client(gw)
        with pytest.raises(openai.NotFoundError) as info:
            await client.audio.voices.create(
                name="v", consent="cons_nobody", audio_sample=("a.wav", wav_bytes(), "audio/wav")
            )
        assert info.value.body["param"] == "consent"
        consent = await client.audio.voice_consents.create(
            name="Me", language="de-DE", recording=("c.wav", wav_bytes(), "audio/wav")
        )
        voice = await client.audio.voices.create(
            name="v", consent=consent.id, audio_sample=("a.wav", wav_bytes(), "audio/wav")
        )
        assert voice.id == "v" and "v" in gw.voices.voices
        await client.close()


async def test_bad_uploads_name_the_field():
    async with serve_http(build_gateway()) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        good = {"name": "N", "language": "en-US"}
        cases = [
            ({"data": {"language": "en-US"}, "files": {"recording": ("c.wav", b"x", "audio/wav")}}, "name"),
            ({"data": {"name": "N"}, "files": {"recording": ("c.wav", b"x", "audio/wav")}}, "language"),
            ({"data": good, "files": {"other": ("c.wav", b"x", "audio/wav")}}, "recording"),
            ({"json": good}, "recording"),
        ]
        for kw, param in cases:
            r = await c.post("/v1/audio/voice_consents", **kw)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (kw, r.text)
        r = await c.get("/v1/audio/voice_consents", params={"limit": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


async def test_the_store_is_bounded():
    store = ConsentStore(max_records=1)
    await store.create("A", "en", b"x")
    with pytest.raises(ResourceExhausted):
        await store.create("B", "en", b"x")
    with pytest.raises(InvalidArgument, match="recording"):
        await store.create("B", "en", b"x" * (10 * 1024 * 1024 + 1))
    with pytest.raises(NotFound):
        await store.check("cons_other")
    await store.check(None)
