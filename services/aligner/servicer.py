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
        if len(request.pcm_f32) % 4:
            raise InvalidArgument(
                f"pcm_f32 must hold whole float32 samples, got {len(request.pcm_f32)} bytes"
            )
        job = AlignJob(
            text=request.text,
            language=request.language,
            pcm=np.frombuffer(request.pcm_f32, dtype="<f4"),
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
