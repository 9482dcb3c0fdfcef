"""gRPC client of the aligner stage: word timestamps of a finished synthesis, in gateway terms.

Words come back as vLLM-Omni serialises them (`{"word", "start_ms", "end_ms"}`, integer
milliseconds of the audio as the client hears it: a `speed` stretch divides the model's times).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import grpc
import numpy as np

from qtts.pb import aligner_pb2, aligner_pb2_grpc
from qtts.request.errors import InvalidArgument, TTSError, Unavailable, from_grpc
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE
from qtts.serving.grpc_server import RECONNECT_OPTIONS
from qtts.serving.internal_auth import client_interceptors
from qtts.serving.log_context import outgoing_metadata
from qtts.serving.tls import TlsConfig, aio_channel

log = logging.getLogger(__name__)

# What an aligner from before `pcm_s16le` says of a request that carries its audio only there.
OLD_ALIGNER_EMPTY = "pcm_f32 is empty"
# How long the audio goes as float32 after such an answer, before 16-bit is tried again: a rolling
# update replaces the old aligners within minutes, and float32 is twice the bytes and a conversion
# on the event loop for every segment.
FLOAT32_RETRY_S = 60.0

# Word splitting the aligner cannot do like the official code (services/aligner refuses it too).
UNALIGNABLE_LANGUAGES = ("korean", "ko", "ko-kr")


def check_alignable(language: str) -> None:
    """Refuse word_timestamps up front for a language the aligner cannot split into words."""
    if language.lower() in UNALIGNABLE_LANGUAGES:
        raise InvalidArgument(
            f"word_timestamps is not available for language {language!r}", param="word_timestamps"
        )


class AlignerClient:
    """Aligns a synthesis's text to its 24 kHz audio through `aligner.v1.AlignerService`."""

    def __init__(
        self,
        address: str,
        token: str = "",
        tls: TlsConfig | None = None,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = aio_channel(
            address, tls, options=RECONNECT_OPTIONS, interceptors=client_interceptors(token)
        )
        self._stub = aligner_pb2_grpc.AlignerServiceStub(self._channel)
        # Until when the audio goes as float32 (clock time), as an aligner from before
        # `pcm_s16le` reads it: set for `FLOAT32_RETRY_S` by each answer from one (a rolling
        # update), so once the old ones are gone the 16-bit audio goes again.
        self._clock = clock
        self._float32_until = -math.inf

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    async def align(
        self,
        request_id: str,
        text: str,
        language: str,
        pcm_s16le: bytes,
        *,
        speed: float = 1.0,
        offset_s: float = 0.0,
    ) -> list[dict]:
        """The words of `text` in `pcm_s16le` (the talker's 24 kHz audio), times in ms of the output."""
        if len(pcm_s16le) < 2:  # not one sample
            return []
        pcm_s16le = pcm_s16le[: len(pcm_s16le) // 2 * 2]
        float32 = self._clock() < self._float32_until
        try:
            resp = await self._call(request_id, text, language, pcm_s16le, float32)
        except InvalidArgument as exc:
            if float32 or not exc.message.startswith(OLD_ALIGNER_EMPTY):
                raise
            log.warning(
                "the aligner at %s reads float32 audio only: sending it so for %g s",
                self.address,
                FLOAT32_RETRY_S,
            )
            self._float32_until = self._clock() + FLOAT32_RETRY_S
            resp = await self._call(request_id, text, language, pcm_s16le, True)
        scale = 1000.0 / speed
        return [
            {
                "word": w.word,
                "start_ms": int(round((w.start_s + offset_s) * scale)),
                "end_ms": int(round((w.end_s + offset_s) * scale)),
            }
            for w in resp.words
        ]

    async def _call(
        self, request_id: str, text: str, language: str, pcm_s16le: bytes, float32: bool
    ) -> aligner_pb2.AlignResponse:
        req = aligner_pb2.AlignRequest(
            request_id=request_id, text=text, language=language, sample_rate_hz=NATIVE_SAMPLE_RATE
        )
        if float32:
            req.pcm_f32 = (
                (np.frombuffer(pcm_s16le, dtype="<i2").astype(np.float32) / 32768.0).astype("<f4").tobytes()
            )
        else:
            # As the talker made it: the aligner scales it on its own featurising thread, so the
            # gateway's event loop (a burst of segments ends at once) only copies bytes.
            req.pcm_s16le = pcm_s16le
        try:
            return await self._stub.Align(req, timeout=self.timeout_s, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"aligner at {self.address}: {exc.details() or exc.code().name}") from None
            raise from_grpc(exc.code(), exc.details()) from None

    async def try_align(self, *args, **kwargs) -> list[dict] | None:
        """`align`, or None when it fails (vLLM-Omni's `timestamps: null`: the audio still goes out)."""
        try:
            return await self.align(*args, **kwargs)
        except TTSError as exc:
            log.warning("word timestamps for %s failed: %s", args[0] if args else "?", exc.message)
            return None

    async def close(self) -> None:
        await self._channel.close()
