"""A GPU stage whose device fails exits non-zero (so Kubernetes restarts it); an ordinary error
fails only its request. And a talker with no reachable code2wav replica is NOT_SERVING until one
is back on the same address.

Real processes on the tiny model; the device error is injected into the talker's engine step or
code2wav's decode by tests/e2e/device_fault.py for request ids starting with "poison".
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from e2e_helpers import poll, tiny_stack_config

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.serving.device_failure import DEVICE_FAILURE_EXIT_CODE
from services.launcher import (
    ServiceSpec,
    StackConfig,
    code2wav_specs,
    free_port,
    health_status,
    start_service,
    stop_services,
    talker_spec,
    wait_serving,
)

pytestmark = pytest.mark.e2e

REF_PCM = (0.3 * np.sin(2 * np.pi * 150 * np.arange(24000) / 24000)).astype("<f4").tobytes()


def _generate(address: str, request_id: str) -> grpc.StatusCode:
    req = talker_pb2.GenerateRequest(
        request_id=request_id,
        text="Hello there.",
        task_type=tts_pb2.TASK_TYPE_VOICE_CLONE,
        reference_pcm_f32=REF_PCM,
        x_vector_only=True,
        max_new_frames=3,
    )
    with grpc.insecure_channel(address) as channel:
        try:
            for _ in talker_pb2_grpc.TalkerServiceStub(channel).Generate(req, timeout=60):
                pass
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _faulty(spec: ServiceSpec, stage: str) -> ServiceSpec:
    return ServiceSpec(
        spec.name + "-faulty", "tests.e2e.device_fault", (stage, *spec.args), spec.grpc_address
    )


@pytest.fixture(scope="module")
def config(snapshot_root, tmp_path_factory) -> StackConfig:
    return tiny_stack_config(
        snapshot_root,
        tmp_path_factory.mktemp("device-failure-logs"),
        drain_seconds=1.0,
        talker_metrics_port=0,
        code2wav_metrics_ports=(0,),
        speaker_cache_port=free_port(),  # nothing listens: prompts are computed in the talker
    )


def test_talker_device_error_exits_non_zero_and_an_ordinary_one_does_not(config):
    (c2w_spec,) = code2wav_specs(config, config.model)
    procs = [start_service(c2w_spec, config.log_dir)]
    try:
        talker = start_service(_faulty(talker_spec(config, config.model), "talker"), config.log_dir)
        procs.append(talker)
        for proc in procs:
            wait_serving(proc, config.startup_timeout_s)
        address = talker.spec.grpc_address
        assert _generate(address, "bad-1") not in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
        assert _generate(address, "ok-1") == grpc.StatusCode.OK
        assert talker.alive() and health_status(address) == "SERVING"

        assert _generate(address, "poison-1") == grpc.StatusCode.UNAVAILABLE
        assert talker.popen.wait(10) == DEVICE_FAILURE_EXIT_CODE
        log = talker.log_path.read_text()
        assert log.count("unrecoverable device error") == 1, talker.log_tail()
    finally:
        stop_services(procs, 5.0)


def test_code2wav_device_error_exits_and_the_talker_waits_for_a_replica(config):
    (c2w_spec,) = code2wav_specs(config, config.model)
    c2w = start_service(_faulty(c2w_spec, "code2wav"), config.log_dir)
    talker = start_service(
        talker_spec(config, config.model, name="talker-2", port=free_port()), config.log_dir
    )
    procs = [c2w, talker]
    try:
        for proc in procs:
            wait_serving(proc, config.startup_timeout_s)
        address = talker.spec.grpc_address
        assert _generate(address, "bad-2") != grpc.StatusCode.OK
        assert c2w.alive() and _generate(address, "ok-2") == grpc.StatusCode.OK

        assert _generate(address, "poison-2") != grpc.StatusCode.OK
        assert c2w.popen.wait(10) == DEVICE_FAILURE_EXIT_CODE
        assert "unrecoverable device error" in c2w.log_path.read_text()
        # Without a decoder the talker cannot serve: it says so, and comes back with a replica.
        assert poll(lambda: health_status(address) == "NOT_SERVING", timeout=10)
        assert health_status(address) == "NOT_SERVING" and talker.alive()
        replacement = start_service(c2w_spec, config.log_dir)
        procs.append(replacement)
        wait_serving(replacement, config.startup_timeout_s)
        assert poll(lambda: health_status(address) == "SERVING", timeout=10)
        assert _generate(address, "ok-3") == grpc.StatusCode.OK
    finally:
        stop_services(procs, 5.0)
