"""Resolves the voice prompt of a voice-clone request: inline clip or named voice, cached by content key.

Lookup order: an in-process LRU, then speaker_cache (`GetVoicePrompt`), then computing it (the
voice worker, or the bundle in this process) and storing it back (`PutVoicePrompt`, in the background). When speaker_cache is
unreachable the prompt is computed locally and the request goes on.

A voice is looked up and computed once however many requests ask for it at the same time (they
wait on the one lookup: a burst of new voices used to compute the same voice once per request).
The computations go through a `VoicePromptBatcher`: the new voices that wait while one batch is
computed go together as the next (services/talker/voice_batches.py). On the GPU the encoders run
in a voice worker process of their own (services/talker/voice_worker.py): computed in the engine
process, a voice prompt waited behind the prompt builds for the one prompt thread, shared its GIL
with the thread driving the frame steps and queued its kernels behind each step, one voice at a
time: 16 ms alone, 432 ms under load.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import numpy as np

from qtts.lru import BoundedLru
from qtts.model.voice_encoders import VoiceClip
from qtts.request.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from qtts.request.vocabulary import unknown_voice
from qtts.streams.voice_key import REFERENCE_NOT_CACHED, voice_prompt_key, voice_prompt_key_for_digest

from .request import GenerationRequest
from .speaker_cache_client import SpeakerCacheClient, SpeakerCacheUnreachable, VoicePromptArrays
from .voice_batches import DEFAULT_MAX_BATCH, VoicePromptBatcher, one_by_one

log = logging.getLogger(__name__)

SAMPLE_RATE = 24000


def prompt_to_record(prompt: Any, model_id: str) -> VoicePromptArrays:
    """`qtts.model.VoicePrompt` -> transport record."""
    codes = None
    if prompt.ref_codes is not None:
        codes = prompt.ref_codes.detach().to("cpu").numpy().astype(np.int16)
    return VoicePromptArrays(
        model_id=model_id,
        x_vector=prompt.x_vector.detach().to("cpu").float().numpy().reshape(-1),
        ref_codes=codes,
        reference_text=prompt.ref_text,
        x_vector_only=bool(prompt.x_vector_only),
    )


def record_to_prompt(record: VoicePromptArrays) -> Any:
    """Transport record -> `qtts.model.VoicePrompt` (CPU tensors; the prompt builder places them)."""
    import torch

    from qtts.model import VoicePrompt

    codes = None if record.ref_codes is None else torch.from_numpy(record.ref_codes.astype(np.int64))
    return VoicePrompt(
        x_vector=torch.from_numpy(record.x_vector.astype(np.float32)),
        ref_codes=codes,
        ref_text=record.reference_text,
        x_vector_only=record.x_vector_only,
    )


class VoiceResolver:
    """Finds or computes the `VoicePrompt` of a voice-clone request."""

    def __init__(
        self,
        bundle: Any,
        cache: SpeakerCacheClient,
        model_id: str,
        local_entries: int = 1024,
        metrics: Any = None,
        worker: Any = None,
        max_batch: int = DEFAULT_MAX_BATCH,
    ):
        """`worker`: a started `VoiceWorker` that computes the prompts (the resolver stops it on
        close); without one, `bundle` computes them in a thread of this process."""
        self._bundle = bundle
        self._cache = cache
        self._model_id = model_id
        # A prompt is small (an x-vector and the reference codes: about 10 KB for a 3 s clip).
        self._local: BoundedLru[str, Any] = BoundedLru(local_entries)
        self._background: set[asyncio.Task] = set()
        # key -> the one lookup (speaker_cache, then compute) every request for that voice awaits.
        self._inflight: dict[str, asyncio.Task] = {}
        self._worker = worker
        if worker is not None:
            compute_many = worker.compute_many
        elif hasattr(bundle, "compute_voice_prompts"):
            compute_many = bundle.compute_voice_prompts
        else:
            compute_many = one_by_one(bundle.compute_voice_prompt)
        # With metrics (a ServiceMetrics): each voice's wait for the encoders as the stage
        # voice_prompt_queue, the computation that gave its prompt as compute_voice_prompt.
        self._batcher = VoicePromptBatcher(compute_many, max_batch=max_batch, metrics=metrics)
        self.computed = 0  # prompts computed here (not found in this process or speaker_cache)

    @property
    def batcher(self) -> VoicePromptBatcher:
        return self._batcher

    async def resolve(self, req: GenerationRequest) -> Any:
        if req.reference_digest and not req.reference_pcm_f32:
            return await self._by_digest(req.reference_digest)
        pcm, ref_text, x_vector_only = await self._reference(req)
        if pcm.size == 0:
            raise InvalidArgument("the reference audio is empty")
        if not x_vector_only and not (ref_text or "").strip():
            raise InvalidArgument(
                "voice clone needs reference_text (the transcript) unless x_vector_only is set"
            )
        # The clip's bytes as they came, or (a named voice) its float32 bytes.
        raw = req.reference_pcm_f32 or pcm.astype("<f4").tobytes()
        key = voice_prompt_key(self._model_id, raw, ref_text, x_vector_only)
        local = self._local.get(key)
        if local is not None:
            return local
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._find_or_compute(key, pcm, ref_text, x_vector_only))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._lookup_done, key))
        # Shielded: a caller that goes away does not cancel the lookup the others wait on.
        return await asyncio.shield(task)

    def _lookup_done(self, key: str, task: asyncio.Task) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone, and the error is theirs

    async def _find_or_compute(
        self, key: str, pcm: np.ndarray, ref_text: str | None, x_vector_only: bool
    ) -> Any:
        prompt, reachable = await self._held(key)
        if prompt is not None:
            return prompt
        prompt = await self._compute(pcm, ref_text, x_vector_only)
        self.computed += 1
        if reachable:
            self._store_in_background(key, prompt)
        self._remember(key, prompt)
        return prompt

    async def _held(self, key: str) -> tuple[Any, bool]:
        """(the prompt of `key` from this process or speaker_cache, or None; whether
        speaker_cache answered)."""
        local = self._local.get(key)
        if local is not None:
            return local, True
        if self._cache.address is None:
            return None, False
        try:
            record = await self._cache.get_prompt(key)
        except SpeakerCacheUnreachable as exc:
            log.warning("computing the voice prompt locally: %s", exc.message)
            return None, False
        if record is None:
            return None, True
        prompt = record_to_prompt(record)
        self._remember(key, prompt)
        return prompt, True

    async def _by_digest(self, digest: str) -> Any:
        """The prompt of a clip the caller sent before (talker.v1 `reference_digest`)."""
        prompt, _ = await self._held(voice_prompt_key_for_digest(self._model_id, digest))
        if prompt is None:
            raise FailedPrecondition(
                f"{REFERENCE_NOT_CACHED}: send reference_pcm_f32 (reference_digest {digest[:12]}...)",
                param="reference_digest",
            )
        return prompt

    async def _reference(self, req: GenerationRequest) -> tuple[np.ndarray, str | None, bool]:
        if req.reference_pcm_f32:
            pcm = np.frombuffer(req.reference_pcm_f32, dtype="<f4")
            return pcm, req.reference_text or None, req.x_vector_only
        try:
            voice = await self._cache.get_voice(req.voice)
        except SpeakerCacheUnreachable as exc:
            raise Unavailable(f"named voice {req.voice!r} cannot be loaded: {exc.message}") from None
        except NotFound:
            raise unknown_voice(req.voice) from None
        pcm = voice.pcm_f32
        if voice.sample_rate_hz != SAMPLE_RATE:
            import soxr

            pcm = soxr.resample(pcm, voice.sample_rate_hz, SAMPLE_RATE).astype(np.float32)
        return pcm, voice.reference_text or None, voice.x_vector_only or req.x_vector_only

    async def _compute(self, pcm: np.ndarray, ref_text: str | None, x_vector_only: bool) -> Any:
        clip = VoiceClip(
            np.array(pcm, dtype=np.float32),  # a writable copy: torch wraps it
            None if x_vector_only else ref_text,
            x_vector_only,
        )
        try:
            return await self._batcher.compute(clip)
        except ValueError as exc:
            raise InvalidArgument(f"cannot compute the voice prompt: {exc}") from exc

    def _store_in_background(self, key: str, prompt: Any) -> None:
        async def store() -> None:
            try:
                await self._cache.put_prompt(key, prompt_to_record(prompt, self._model_id))
            except Exception as exc:  # noqa: BLE001 - a failed store only costs a recompute later
                log.warning("could not store voice prompt %s in speaker_cache: %s", key[:12], exc)

        task = asyncio.create_task(store())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _remember(self, key: str, prompt: Any) -> None:
        self._local.put(key, prompt)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Let pending stores finish (briefly), then cancel what is left."""
        pending = set(self._background)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._batcher.close()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)
