"""The gateway's talker pool against two real talker processes (tiny model, shared code2wav and
speaker_cache) behind a resolver that changes at run time: streams go to the second talker once it
resolves, and all of them to it once the first one leaves the resolution."""

from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest

from qtts.request.vocabulary import SynthesisSummary
from services.gateway.job import SynthesisJob
from services.gateway.talker_client import TalkerClient
from services.gateway.talker_pool import StaticResolver, TalkerPool
from services.launcher import (
    StackConfig,
    StartupError,
    free_port,
    start_service,
    start_stack,
    stop_services,
    talker_spec,
    wait_serving,
)
from tests.synthesis_jobs import talker_job

pytestmark = pytest.mark.e2e


def generate_calls(metrics_port: int) -> int:
    """Generate calls that ended OK, from the talker's own tts_rpc_requests_total."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("tts_rpc_requests_total{")
            and 'method="/talker.v1.TalkerService/Generate"' in line
            and 'code="OK"' in line
        )
    )


def job(i: int) -> SynthesisJob:
    ref = (0.3 * np.sin(np.arange(24000) / 10)).astype(np.float32)
    return talker_job(
        f"pool-{i}", text="Hello.", task="voice_clone", voice="", x_vector_only=True, reference_pcm=ref
    )


async def synthesize(client: TalkerClient, i: int) -> None:
    events = [e async for e in client.generate(job(i))]
    assert isinstance(events[-1], SynthesisSummary), events[-1]


async def test_new_streams_reach_a_talker_process_added_at_run_time(tmp_path):
    config = StackConfig.on_free_ports(startup_timeout_s=300.0, drain_seconds=2.0, log_dir=tmp_path / "logs")
    try:
        stack = await asyncio.to_thread(start_stack, config)
    except StartupError as exc:
        pytest.fail(f"stack did not start: {exc}")
    second_port, second_metrics = free_port(), free_port()
    second = start_service(
        talker_spec(config, stack.model, name="talker-2", port=second_port, metrics_port=second_metrics),
        config.log_dir,
    )
    first, second_addr = f"127.0.0.1:{config.talker_port}", f"127.0.0.1:{second_port}"
    resolver = StaticResolver([first])
    pool = TalkerPool(resolver, refresh_s=0.1)
    client = TalkerClient(first, pool=pool)
    try:
        await asyncio.to_thread(wait_serving, second, 300.0)
        pool.start()
        await asyncio.gather(*(synthesize(client, i) for i in range(4)))
        assert generate_calls(config.talker_metrics_port) == 4 and generate_calls(second_metrics) == 0

        resolver.addresses = [first, second_addr]
        for _ in range(100):
            if len(pool.usable()) == 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.gather(*(synthesize(client, 10 + i) for i in range(6)))
        on_second = generate_calls(second_metrics)
        assert on_second >= 3, on_second  # equal load: round robin over both

        resolver.addresses = [second_addr]
        for _ in range(100):
            if [e.address for e in pool.usable()] == [second_addr]:
                break
            await asyncio.sleep(0.05)
        before = generate_calls(config.talker_metrics_port)
        await asyncio.gather(*(synthesize(client, 20 + i) for i in range(4)))
        assert generate_calls(config.talker_metrics_port) == before
        assert generate_calls(second_metrics) == on_second + 4
    finally:
        await client.close()
        stop_services([second], 10.0)
        stack.stop(grace=10.0)
