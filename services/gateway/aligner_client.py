"""gRPC client of the aligner stage: word timestamps of a finished synthesis, in gateway terms.

Words come back as vLLM-Omni serialises them (`{"word", "start_ms", "end_ms"}`, integer
milliseconds of the audio as the client hears it: a `speed` stretch divides the model's times).
"""

from __future__ import annotations

import logging

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

    def __init__(self, address: str, token: str = "", tls: TlsConfig | None = None, timeout_s: float = 30.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = aio_channel(
            address, tls, options=RECONNECT_OPTIONS, interceptors=client_interceptors(token)
        )
        self._stub = aligner_pb2_grpc.AlignerServiceStub(self._channel)
        # Set once an aligner answered as one from before `pcm_s16le` (a rolling update): the
        # audio then goes as float32, as those read it.
        self._float32_only = False

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
        try:
            resp = await self._call(request_id, text, language, pcm_s16le)
        except InvalidArgument as exc:
            if self._float32_only or not exc.message.startswith(OLD_ALIGNER_EMPTY):
                raise
            log.warning("the aligner at %s reads float32 audio only: sending it so", self.address)
            self._float32_only = True
            resp = await self._call(request_id, text, language, pcm_s16le)
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
        self, request_id: str, text: str, language: str, pcm_s16le: bytes
    ) -> aligner_pb2.AlignResponse:
        req = aligner_pb2.AlignRequest(
            request_id=request_id, text=text, language=language, sample_rate_hz=NATIVE_SAMPLE_RATE
        )
        if self._float32_only:
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
