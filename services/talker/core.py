"""The talker's transport-agnostic core: validate, resolve the voice, build the prompt, stream audio."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from qtts.request import request_limits as lim
from qtts.request.errors import Cancelled, InvalidArgument, ResourceExhausted, TTSError
from qtts.request.sampling_overrides import sampling_fields
from qtts.request.vocabulary import AudioPiece, SynthesisSummary, Task
from qtts.serving.metrics import TalkerMetrics
from qtts.streams.chunk_plan import StartPlanner

from .generation_loop import GenerationLoop
from .prompt_queue import PromptQueue, reference_rows
from .replicas import Code2WavReplicas
from .request import GenerationRequest, SamplingOverrides
from .room import FrontRoom, RoomNews
from .stream import StreamSession
from .validation import check_request
from .voices import VoiceResolver

__all__ = ["TalkerCore", "merge_sampling", "reference_rows"]  # reference_rows: engine_process's


def merge_sampling(defaults: Any, overrides: SamplingOverrides) -> Any:
    """The model's generation defaults with the caller's set fields on top (`check_request` has
    checked their declared ranges)."""
    # Each set field under its declared model name (generation_config.json's).
    changes = {
        f.model_name: value for f in sampling_fields() if (value := getattr(overrides, f.name)) is not None
    }
    if overrides.greedy:
        # The API's greedy means argmax for every codebook, the code predictor's included.
        changes["greedy"] = True
        if any(f.name == "subtalker_greedy" for f in dataclasses.fields(defaults)):
            changes["subtalker_greedy"] = True
    return dataclasses.replace(defaults, **changes) if changes else defaults


class TalkerCore:
    """Serves generation requests on a loaded `TalkerBundle` through the engine and code2wav."""

    def __init__(
        self,
        *,
        bundle: Any,
        engine: GenerationLoop,
        replicas: Code2WavReplicas,
        voices: VoiceResolver,
        metrics: TalkerMetrics,
        credit_window_frames: int,
        stall_timeout_s: float = 0.0,
        spec_factory: Callable[..., Any] | None = None,
        first_audio_budget_s: float = 0.0,
        start_planner: StartPlanner | None = None,
    ):
        self.bundle = bundle
        # Each new stream's first chunk (default: the default policy, trips of the first chunks).
        self._start_planner = start_planner if start_planner is not None else StartPlanner()
        # The first queue a request waits in, under the first-audio budget.
        self.prompts = PromptQueue(bundle, metrics, first_audio_budget_s)
        self.info = bundle.info
        self._engine = engine
        self._replicas = replicas
        self._voices = voices
        self._metrics = metrics
        self._window = credit_window_frames
        self._stall_timeout_s = stall_timeout_s
        self._spec_factory = spec_factory
        # The engine process's last room, for refusals here at once (room.FrontRoom).
        self.front_room = FrontRoom()
        # Wakes the WatchCapacity calls to send the room a stream's error freed (room.RoomNews).
        self.room_news = RoomNews()

    async def generate(
        self, req: GenerationRequest, text: AsyncIterator[tuple[str, bool]] | None = None
    ) -> AsyncIterator[AudioPiece | SynthesisSummary]:
        """Audio pieces as code2wav produces them, then one summary (errors are TTSError).

        With `text`, more text follows `req.text` while the request runs: (piece, final) pairs in
        order, the end of the iterator completing the text as a final piece does."""
        started_at = time.perf_counter()
        if not req.request_id:
            req = dataclasses.replace(req, request_id=uuid.uuid4().hex)
        checked = check_request(req, self.info)
        sampling = merge_sampling(self.bundle.generation_defaults, req.sampling)
        in_engine = text is None and hasattr(self.bundle, "build_prompt_async")
        if text is None:
            # The at-once refusals before the voice too: a refused request costs no voice prompt
            # (a speaker_cache round trip, or the encoders on the GPU for a new clip). They run
            # again where the prompt is queued, over the prompts queued meanwhile.
            self._refuse_at_once(in_engine)
        voice_prompt = None
        if checked.task == Task.VOICE_CLONE:
            with self._metrics.stage_timer("voice_prompt"):
                voice_prompt = await self._voices.resolve(req)
        # Built in the prompt thread, the host copy of the reference frames too: that copy waits
        # for the GPU (behind the engine's step), which must never block the event loop.
        queued_at = time.perf_counter()
        open_text = None
        if in_engine:
            prompt, ref_codes = await self._build_in_engine(req, checked, voice_prompt, queued_at)
        elif text is None:
            prompt, ref_codes = await self._build_in_thread(req, checked, voice_prompt, queued_at)
        else:
            open_text = self._open_text(req, checked, voice_prompt)
            prompt, ref_codes = await self._open_prompt(open_text, req.text, text)
        session = self._new_session(req, prompt, sampling, ref_codes, started_at)
        feeder = None
        if open_text is not None and not open_text.closed:
            feeder = asyncio.create_task(self._feed_text(open_text, text, session))
        try:
            # aclosing: a caller that stops early (client gone) frees the stream at once, not at GC.
            async with contextlib.aclosing(session.run()) as items:
                async for item in items:
                    yield item
        except Exception as exc:
            # The engine has let the stream go (failed it, or was told to cancel it), and its
            # caller hears of the end at once: the gateways hear of the room it freed first, or a
            # retry sent right away finds a gateway still holding the talker's room from before
            # (room.RoomNews). A refusal freed nothing (and comes in bulk under overload).
            if not isinstance(exc, ResourceExhausted):
                await self.room_news.publish()
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder

    async def _build_in_thread(
        self, req: GenerationRequest, checked: Any, voice_prompt: Any, queued_at: float
    ) -> tuple[Any, np.ndarray | None]:
        """The prompt built in this process's prompt thread, after the at-once refusals (a full
        prompt queue, then the engine's admission counting the prompts ahead)."""
        self._refuse_at_once(in_engine=False)
        with self.prompts.waiting_for(queued_at):  # built with the prompts queued beside it
            return await self.prompts.build(self._spec(req, checked, voice_prompt), queued_at)

    def _new_session(
        self, req: GenerationRequest, prompt: Any, sampling: Any, ref_codes: Any, started_at: float
    ) -> StreamSession:
        """The stream that steps `prompt` in the engine and relays its frames to code2wav."""
        return StreamSession(
            request_id=req.request_id,
            prompt=prompt,
            sampling=sampling,
            max_new_frames=req.max_new_frames or None,
            ref_codes=ref_codes,
            num_codebooks=self.info.num_codebooks,
            first_chunk_frames=req.first_chunk_frames,
            chunk_frames_ramp=req.chunk_frames_ramp,
            engine=self._engine,
            replicas=self._replicas,
            window=self._window,
            started_at=started_at,
            stall_timeout_s=self._stall_timeout_s,
            metrics=self._metrics,
            start_planner=self._start_planner,
            start_counts=self._start_counts,
        )

    def _start_counts(self) -> tuple[int, int, int]:
        """How busy the talker is for a new stream's chunk plan (`StartPlanner.plan`): the engine's
        counts, with the requests still waiting for their prompts as streams starting (and, once
        queued `StartPlanner.BACKLOG_AGE_S`, as a backlog)."""
        starting, streams, backlog = self._engine.start_counts()
        waiting, old = self.prompts.start_counts(time.perf_counter())
        return starting + waiting, streams + waiting, backlog + old

    async def _build_in_engine(
        self, req: GenerationRequest, checked: Any, voice_prompt: Any, queued_at: float
    ) -> tuple[Any, np.ndarray | None]:
        """The prompt built in the engine process (engine_process.RemoteBundle), many in flight:
        its prompt queue and budget are there; this side counts them for the at-once refusal."""
        self.prompts.check()
        self._refuse_by_room()  # again: the voice prompt took time, and other builds went meanwhile
        with self.prompts.waiting_for(queued_at):
            try:
                future = self.bundle.build_prompt_async(
                    self._spec(req, checked, voice_prompt), queued_at, self.prompts.budget_s
                )
                self.front_room.build_sent()
                prompt = await asyncio.wrap_future(future)
            except asyncio.CancelledError:  # the caller went away: the engine process frees the prompt
                self.bundle.abandon_build(future)
                raise
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from exc
        self.prompts.build_s = prompt.build_s  # the engine process keeps the average
        return prompt, prompt.ref_codes_host

    async def _open_prompt(
        self, open_text: Any, first: str, text: AsyncIterator[tuple[str, bool]]
    ) -> tuple[Any, np.ndarray | None]:
        """Push text until the prompt can be built (an ICL prompt waits for text past its
        reference frames); a request that ends first frees the text the engine process holds."""
        try:
            built = await self._push_text(open_text, first, False)
            while built is None:
                piece, final = await anext(text, ("", True))
                built = await self._push_text(open_text, piece, final)
        except BaseException:
            abandon = getattr(open_text, "abandon", None)  # engine_process.RemoteOpenText
            if abandon is not None:
                abandon()
            raise
        return built

    def _open_text(self, req: GenerationRequest, checked: Any, voice_prompt: Any) -> Any:
        from qtts.model.open_text import OpenText

        spec = dataclasses.replace(self._spec(req, checked, voice_prompt), text="", text_open=True)
        remote = getattr(self.bundle, "open_text", None)
        if remote is not None:  # the engine process holds the text (engine_process.RemoteBundle)
            return remote(spec)
        stream = self.prompts.cuda_stream()
        return OpenText(
            self.bundle.prompt_builder,
            spec,
            max_positions=getattr(self._engine.generator, "max_text_positions", None),
            sync=stream.synchronize if stream is not None else (lambda: None),
        )

    async def _push_text(
        self, open_text: Any, piece: str, final: bool
    ) -> tuple[Any, np.ndarray | None] | None:
        """Hand a piece to `open_text` in the prompt thread (in arrival order, after the prompts
        queued before it); the prompt and its reference frames once it is built, else None."""
        if len(open_text.text) + len(piece) > lim.TEXT_MAX_CHARS:
            raise InvalidArgument(f"the text is longer than {lim.TEXT_MAX_CHARS} characters", param="text")
        return await self.prompts.run(self.prompts.push, open_text, piece, final)

    async def _feed_text(
        self, open_text: Any, text: AsyncIterator[tuple[str, bool]], session: StreamSession
    ) -> None:
        """Append the rest of the text to the running stream; a refused piece fails the stream."""
        try:
            async for piece, final in text:
                await self._push_text(open_text, piece, final)
                self._engine.text_appended()
                if final:
                    return
            if not open_text.closed:  # the caller's side ended: the text is complete
                await self._push_text(open_text, "", True)
                self._engine.text_appended()
        except asyncio.CancelledError:
            raise
        except TTSError as exc:
            session.fail(exc)
        except Exception as exc:  # the caller's request stream broke
            session.fail(Cancelled(f"the text stream ended with an error: {type(exc).__name__}"))

    async def headroom(self) -> Any:
        """The engine's room for new requests (forecast.Headroom), counting the prompts this side
        builds (an engine process counts the ones it builds itself)."""
        remote = getattr(self._engine, "headroom_async", None)
        if remote is not None:
            sent = self.front_room.asking()  # the builds sent before this call: the engine counts them
            room = await asyncio.wrap_future(remote())
            self.front_room.heard(room, sent)
            return room
        return self._engine.headroom(self.prompts.waiting)

    def observe_published_room(self, accept: int) -> None:
        """One room sent to a gateway (GetCapacity or WatchCapacity): `accept` requests."""
        self._metrics.published_room_streams.observe(accept)

    def observe_room_worked_out(self, seconds: float, calls_seen: int) -> None:
        """A room for a gateway took `seconds` to work out (the engine's answer), and that
        gateway's calls seen meanwhile were `calls_seen` (counted in the room's queue and again
        by the gateway as not yet seen: room lost to the gateway for that message)."""
        self._metrics.room_seconds.observe(seconds)
        self._metrics.room_calls_seen_meanwhile.observe(calls_seen)

    def _refuse_at_once(self, in_engine: bool) -> None:
        """The refusals a request gets before it queues for its prompt: a full prompt queue, then
        (prompts built in this process) the engine's admission counting the prompts ahead. With
        the engine in its own process, the front refuses by the engine's last room while it is
        fresh (`FrontRoom`); otherwise that process applies its admission when the build comes."""
        self.prompts.check()
        if not in_engine:
            self._engine.check_admission(self.prompts.waiting)
        else:
            self._refuse_by_room()

    def _refuse_by_room(self) -> None:
        """With the engine in its own process: refuse at once where its last room is spent."""
        refusal = self.front_room.refusal()
        if refusal is not None:
            self._metrics.refused_total.inc()
            self._metrics.room_refused_total.inc()
            raise refusal

    def _spec(self, req: GenerationRequest, checked: Any, voice_prompt: Any) -> Any:
        if self._spec_factory is None:
            from qtts.model import SynthesisSpec

            self._spec_factory = SynthesisSpec
        return self._spec_factory(
            text=req.text,
            task=checked.task,
            speaker=checked.speaker,
            language=checked.language,
            instruct=req.instructions or None,
            voice_prompt=voice_prompt,
            streaming_text=req.streaming_text,
        )
