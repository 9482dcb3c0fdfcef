"""Redis store (redis-py asyncio): prompts under `tts:prompt:<key>`, voices under `tts:voice:<name>`,
voice consents under `tts:consent:<id>`.

Each record is a Redis hash of its fields (binary-safe). The set `tts:voices` holds the voice names
for listing, the sorted set `tts:consents` the consent ids in creation order (scored by the counter
`tts:consent_seq`). Voices and consents persist as long as Redis does; prompts are a cache and may
carry a TTL.

Run Redis with `--maxmemory-policy volatile-lru` (deploy/): only keys with a TTL, the prompts, are
evicted when memory runs out, never a named voice; a write that still finds no room (memory full of
voices) fails with ResourceExhausted, not silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    OutOfMemoryError,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from qtts.request.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.speaker_cache.records import ConsentRecord, PromptRecord, VoiceRecord

T = TypeVar("T")

log = logging.getLogger(__name__)

_VOICE_LIST_FIELDS = ("name", "sample_rate_hz", "reference_text", "x_vector_only", "created_unix_s")


def _unavailable_on_redis_errors(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A lost Redis is a stage that is not serving, not an internal error."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except (AuthenticationError, AuthenticationWrongNumberOfArgsError) as exc:
            raise _refused_credentials(exc) from exc
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("redis unavailable: %s", exc)
            raise Unavailable("the voice store (Redis) is unavailable") from exc
        except RedisError as exc:
            if isinstance(exc, OutOfMemoryError):
                # maxmemory reached with nothing evictable left (only named voices, which carry no
                # TTL, so volatile-lru never evicts them): say so instead of a generic outage.
                raise ResourceExhausted(
                    "the voice store is full (Redis maxmemory): delete voices or give Redis more memory"
                ) from exc
            # The reply names commands and keys: for the log, not for the caller.
            log.error("redis error: %s", exc)
            raise Unavailable("the voice store (Redis) failed the request") from exc

    return wrapper


def _refused_credentials(exc: Exception) -> Unavailable:
    # Redis's reply names no password; neither does this (the URL is never part of it).
    log.error(
        "redis refused speaker_cache's credentials (%s): check the password and user in "
        "--redis-url or --redis-username / --redis-password(-file)",
        exc,
    )
    return Unavailable("the voice store (Redis) refused this service's credentials")


# KEYS: the voices set, the voice's hash; ARGV: name, max voices, overwrite (0/1).
# Returns _EXISTS, _FULL, _NEW (a new name claimed) or _REPLACED (an existing one, overwrite).
_CLAIM_VOICE = """
local known = redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1
if known then
  if ARGV[3] == '0' then return 0 end
  return 3
end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 1 end
redis.call('HSET', KEYS[2], 'name', ARGV[1])
redis.call('SADD', KEYS[1], ARGV[1])
return 2
"""
_EXISTS, _FULL, _NEW, _REPLACED = 0, 1, 2, 3

# KEYS: the consents zset, the consent's hash, the sequence counter; ARGV: id, max records,
# create (0/1), then the hash's field/value pairs. Returns _EXISTS, _FULL, _NEW, _REPLACED or
# _ABSENT (replace of an unknown id): one script, so that replicas sharing a Redis never pass the
# bound or lose the order.
_PUT_CONSENT = """
local known = redis.call('EXISTS', KEYS[2]) == 1
if ARGV[3] == '1' then
  if known then return 0 end
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 1 end
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[3]), ARGV[1])
elseif not known then
  return 4
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
if ARGV[3] == '1' then return 2 end
return 3
"""
_ABSENT = 4
_CONSENT_FIELDS = ("id", "name", "language", "created_unix_s", "recording_sha256", "recording_bytes")


class RedisStore:
    """`SpeakerStore` on Redis; several speaker_cache replicas may share one Redis."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "tts:",
        prompt_ttl_s: int = 0,
        timeout_s: float = 5.0,
        max_voices: int = 10_000,
        username: str | None = None,
        password: str | None = None,
        ssl_ca_certs: str | None = None,
    ):
        self.namespace = namespace
        self.prompt_ttl_s = prompt_ttl_s
        self.max_voices = max_voices
        # The URL's own user / password win over these in redis-py; the config refuses both.
        extra: dict[str, Any] = {"username": username, "password": password}
        if ssl_ca_certs:
            extra["ssl_ca_certs"] = ssl_ca_certs
        self._redis = aioredis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **extra
        )
        self._claim = self._redis.register_script(_CLAIM_VOICE)
        self._put_consent = self._redis.register_script(_PUT_CONSENT)

    def _prompt_key(self, key: str) -> str:
        return f"{self.namespace}prompt:{key}"

    def _voice_key(self, name: str) -> str:
        return f"{self.namespace}voice:{name}"

    @property
    def _voices_set(self) -> str:
        return f"{self.namespace}voices"

    @_unavailable_on_redis_errors
    async def ping(self) -> None:
        await self._redis.ping()

    @_unavailable_on_redis_errors
    async def get_prompt(self, key: str) -> PromptRecord | None:
        h = await self._redis.hgetall(self._prompt_key(key))
        if not h:
            return None
        return PromptRecord(
            model_id=h[b"model_id"].decode(),
            x_vector_f32=h[b"x_vector_f32"],
            x_vector_dim=int(h[b"x_vector_dim"]),
            reference_codes_i16=h.get(b"reference_codes_i16", b""),
            num_reference_frames=int(h.get(b"num_reference_frames", 0)),
            num_codebooks=int(h.get(b"num_codebooks", 0)),
            reference_text=h.get(b"reference_text", b"").decode(),
            x_vector_only=h.get(b"x_vector_only") == b"1",
        )

    @_unavailable_on_redis_errors
    async def put_prompt(self, key: str, prompt: PromptRecord) -> None:
        rkey = self._prompt_key(key)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(rkey)
            pipe.hset(
                rkey,
                mapping={
                    "model_id": prompt.model_id,
                    "x_vector_f32": prompt.x_vector_f32,
                    "x_vector_dim": prompt.x_vector_dim,
                    "reference_codes_i16": prompt.reference_codes_i16,
                    "num_reference_frames": prompt.num_reference_frames,
                    "num_codebooks": prompt.num_codebooks,
                    "reference_text": prompt.reference_text,
                    "x_vector_only": int(prompt.x_vector_only),
                },
            )
            if self.prompt_ttl_s > 0:
                pipe.expire(rkey, self.prompt_ttl_s)
            await pipe.execute()

    @_unavailable_on_redis_errors
    async def create_voice(self, voice: VoiceRecord, overwrite: bool) -> VoiceRecord:
        rkey = self._voice_key(voice.name)
        # One script claims the name and a place under --max-voices atomically, even with several
        # replicas sharing the Redis (a count, then a write, would let a race pass the limit).
        claimed = await self._claim(
            keys=[self._voices_set, rkey], args=[voice.name, self.max_voices, int(overwrite)]
        )
        if claimed == _EXISTS:
            raise AlreadyExists(f"voice {voice.name!r} already exists")
        if claimed == _FULL:
            raise ResourceExhausted(f"voice limit reached ({self.max_voices})")
        try:
            await self._write_voice(rkey, voice, overwrite)
        except BaseException:
            if claimed == _NEW:  # release the claim, or the name would stay taken by a half-written voice
                with contextlib.suppress(RedisError):
                    async with self._redis.pipeline(transaction=True) as pipe:
                        pipe.delete(rkey)
                        pipe.srem(self._voices_set, voice.name)
                        await pipe.execute()
            raise
        return voice

    async def _write_voice(self, rkey: str, voice: VoiceRecord, overwrite: bool) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            if overwrite:
                pipe.delete(rkey)
            pipe.hset(
                rkey,
                mapping={
                    "name": voice.name,
                    "reference_pcm_f32": voice.reference_pcm_f32,
                    "sample_rate_hz": voice.sample_rate_hz,
                    "reference_text": voice.reference_text,
                    "x_vector_only": int(voice.x_vector_only),
                    "created_unix_s": voice.created_unix_s,
                },
            )
            pipe.sadd(self._voices_set, voice.name)
            await pipe.execute()

    @_unavailable_on_redis_errors
    async def get_voice(self, name: str) -> VoiceRecord:
        h = await self._redis.hgetall(self._voice_key(name))
        if not h or b"reference_pcm_f32" not in h:
            raise NotFound(f"voice {name!r} not found")
        return _voice_from_fields(h)

    @_unavailable_on_redis_errors
    async def list_voices(self) -> list[VoiceRecord]:
        names = sorted(n.decode() for n in await self._redis.smembers(self._voices_set))
        if not names:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hmget(self._voice_key(name), _VOICE_LIST_FIELDS)
                pipe.hstrlen(self._voice_key(name), "reference_pcm_f32")
            replies = await pipe.execute()
        voices = []
        for row, audio_bytes in zip(replies[::2], replies[1::2], strict=True):
            if row[0] is None:
                continue  # deleted between SMEMBERS and HMGET
            voice = _voice_from_fields(dict(zip((f.encode() for f in _VOICE_LIST_FIELDS), row, strict=True)))
            voices.append(dataclasses.replace(voice, num_samples=int(audio_bytes) // 4))
        return voices

    @_unavailable_on_redis_errors
    async def delete_voice(self, name: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._voice_key(name))
            pipe.srem(self._voices_set, name)
            deleted, _ = await pipe.execute()
        if not deleted:
            raise NotFound(f"voice {name!r} not found")

    @_unavailable_on_redis_errors
    async def count_voices(self) -> int:
        return int(await self._redis.scard(self._voices_set))

    def _consent_key(self, consent_id: str) -> str:
        return f"{self.namespace}consent:{consent_id}"

    @_unavailable_on_redis_errors
    async def put_consent(self, consent: ConsentRecord, create: bool) -> ConsentRecord:
        fields = []
        for name in _CONSENT_FIELDS:
            fields += [name, getattr(consent, name)]
        done = await self._put_consent(
            keys=[f"{self.namespace}consents", self._consent_key(consent.id), f"{self.namespace}consent_seq"],
            args=[consent.id, self.max_voices, int(create), *fields],
        )
        if done == _EXISTS:
            raise AlreadyExists(f"consent {consent.id!r} already exists")
        if done == _FULL:
            raise ResourceExhausted(f"consent limit reached ({self.max_voices})")
        if done == _ABSENT:
            raise NotFound(f"no voice consent {consent.id!r}")
        return consent

    @_unavailable_on_redis_errors
    async def get_consent(self, consent_id: str) -> ConsentRecord:
        h = await self._redis.hgetall(self._consent_key(consent_id))
        if not h:
            raise NotFound(f"no voice consent {consent_id!r}")
        return _consent_from_fields(h)

    @_unavailable_on_redis_errors
    async def list_consents(self, after: str, limit: int) -> tuple[list[ConsentRecord], bool]:
        zset = f"{self.namespace}consents"
        start = 0
        if after:
            rank = await self._redis.zrank(zset, after)
            if rank is None:
                raise InvalidArgument(f"after: no voice consent {after!r}", param="after")
            start = rank + 1
        ids = [i.decode() for i in await self._redis.zrange(zset, start, start + limit)]  # one extra
        more, ids = len(ids) > limit, ids[:limit]
        async with self._redis.pipeline(transaction=False) as pipe:
            for consent_id in ids:
                pipe.hgetall(self._consent_key(consent_id))
            rows = await pipe.execute() if ids else []
        return [_consent_from_fields(h) for h in rows if h], more

    @_unavailable_on_redis_errors
    async def delete_consent(self, consent_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._consent_key(consent_id))
            pipe.zrem(f"{self.namespace}consents", consent_id)
            deleted, _ = await pipe.execute()
        if not deleted:
            raise NotFound(f"no voice consent {consent_id!r}")

    async def close(self) -> None:
        await self._redis.aclose()


def _consent_from_fields(h: dict[bytes, bytes]) -> ConsentRecord:
    text = {k.decode(): v.decode() for k, v in h.items()}
    return ConsentRecord(
        id=text.get("id", ""),
        name=text.get("name", ""),
        language=text.get("language", ""),
        created_unix_s=int(text.get("created_unix_s") or 0),
        recording_sha256=text.get("recording_sha256", ""),
        recording_bytes=int(text.get("recording_bytes") or 0),
    )


def _voice_from_fields(h: dict[bytes, bytes | None]) -> VoiceRecord:
    return VoiceRecord(
        name=(h.get(b"name") or b"").decode(),
        reference_pcm_f32=h.get(b"reference_pcm_f32") or b"",
        sample_rate_hz=int(h.get(b"sample_rate_hz") or 0),
        reference_text=(h.get(b"reference_text") or b"").decode(),
        x_vector_only=h.get(b"x_vector_only") == b"1",
        created_unix_s=int(h.get(b"created_unix_s") or 0),
    )
