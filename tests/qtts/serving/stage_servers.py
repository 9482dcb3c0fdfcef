"""The stages that the TLS and internal-token tests start (test_tls.py, test_internal_token.py):
speaker_cache and code2wav on ephemeral ports, a talker with the fake model core, and the job
that the gateway's talker client sends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np

from services.code2wav.config import Code2WavConfig
from services.code2wav.server import Code2WavServer
from services.gateway.job import SynthesisJob
from services.speaker_cache.config import SpeakerCacheConfig
from services.speaker_cache.server import SpeakerCacheServer
from tests.services.talker.fakes import FakeBundle, FakeGenerator, FakeSpec
from tests.services.talker.stack import eventually, talker_stack
from tests.synthesis_jobs import talker_job


@asynccontextmanager
async def speaker_cache_server(**config: Any) -> AsyncIterator[str]:
    """A speaker_cache on an ephemeral port with `config` (e.g. `tls=`, `internal_token=`), once it
    serves: yields its address, stops it after."""
    server = SpeakerCacheServer(
        SpeakerCacheConfig(port=0, metrics_port=0, drain_seconds=0.5, **config).validate()
    )
    port = await server.start()
    try:
        await server.wait_serving()
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.5)


@asynccontextmanager
async def code2wav_server(decoder: Any, replica_name: str, **config: Any) -> AsyncIterator[str]:
    """A code2wav on an ephemeral port decoding with `decoder`, once its engine runs: yields its
    address, stops it after."""
    server = Code2WavServer(
        Code2WavConfig(
            port=0, metrics_port=0, drain_seconds=0.5, replica_name=replica_name, **config
        ).validate(),
        decoder=decoder,
    )
    port = await server.start()
    try:
        await eventually(lambda: server.engine is not None)
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.5)


def fake_talker(code2wav: list, **kwargs: Any):
    """`talker_stack` with the fake model core of a base model (`FakeBundle("base")`)."""
    return talker_stack(
        code2wav, bundle=FakeBundle("base"), generator_factory=FakeGenerator, spec_factory=FakeSpec, **kwargs
    )


def voice_clone_job(request_id: str) -> SynthesisJob:
    """A 3-frame x-vector voice clone (the fake generator reads `frames=3`)."""
    return talker_job(
        request_id,
        text="frames=3",
        task="voice_clone",
        voice="",
        language="auto",
        reference_audio=b"x",
        x_vector_only=True,
        max_new_frames=0,
        reference_pcm=np.zeros(2400, dtype=np.float32),
    )
