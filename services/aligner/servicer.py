"""`aligner.v1.AlignerService`: converts protobuf to an `AlignJob` and calls `AlignerCore`."""

from __future__ import annotations

import grpc
import numpy as np

from qtts.pb import aligner_pb2 as pb
from qtts.pb import aligner_pb2_grpc
from qtts.request.errors import InvalidArgument
from services.aligner.core import AlignerCore, AlignJob


class AlignerServicer(aligner_pb2_grpc.AlignerServiceServicer):
    """Thin gRPC adapter; domain errors become status codes in the server's interceptor."""

    def __init__(self, core: AlignerCore):
        self.core = core

    async def Align(self, request: pb.AlignRequest, context: grpc.aio.ServicerContext) -> pb.AlignResponse:
        job = AlignJob(
            text=request.text,
            language=request.language,
            pcm=_pcm(request),
            sample_rate_hz=request.sample_rate_hz,
            offset_s=request.offset_s,
        )
        out = await self.core.align(job)
        return pb.AlignResponse(
            request_id=request.request_id,
            words=[pb.WordTimestamp(word=w.word, start_s=w.start_s, end_s=w.end_s) for w in out.words],
            forward_ns=out.forward_ns,
            batch_size=out.batch_size,
        )


def _pcm(request: pb.AlignRequest) -> np.ndarray:
    """The request's samples as they came (int16 or float32; `AlignerCore` scales int16 to
    [-1, 1) on its featurising thread, not on this event loop)."""
    if request.pcm_s16le and request.pcm_f32:
        raise InvalidArgument("set pcm_s16le or pcm_f32, not both")
    if request.pcm_s16le:
        if len(request.pcm_s16le) % 2:
            raise InvalidArgument(
                f"pcm_s16le must hold whole 16-bit samples, got {len(request.pcm_s16le)} bytes"
            )
        return np.frombuffer(request.pcm_s16le, dtype="<i2")
    if len(request.pcm_f32) % 4:
        raise InvalidArgument(f"pcm_f32 must hold whole float32 samples, got {len(request.pcm_f32)} bytes")
    return np.frombuffer(request.pcm_f32, dtype="<f4")
