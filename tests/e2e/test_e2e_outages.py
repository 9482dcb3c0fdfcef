"""Stages going away and coming back, through the real processes.

Redis stopped and restarted under load: only the voice API notices, and no voice is lost. A stack
of its own (speaker_cache on a redis-server with the deployed AOF settings, one code2wav, a Base
talker and gateway, plus a CustomVoice talker and gateway for presets) serves a steady stream of
inline-clip and preset requests while Redis goes away and comes back on the same data folder.

The talker killed, then code2wav: the gateway's readiness and gRPC health (and, for code2wav, the
talker's) say NOT_SERVING until a process is back on the same address, then SERVING again.
"""

from __future__ import annotations

import base64
import io
import threading
import time
import wave
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from e2e_helpers import REF_TEXT, poll, tiny_snapshot
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis_process import RedisProcess

from qtts.serving.grpc_server import LIVENESS
from services.launcher import (
    Stack,
    StackConfig,
    free_port,
    gateway_spec,
    start_service,
    start_stack,
    stop_services,
    talker_spec,
    wait_serving,
)

pytestmark = pytest.mark.e2e


def _clip(i: int, seconds: float = 1.0, rate: int = 16000) -> str:
    """A base64 wav unlike every other `i`: a new voice prompt key, so each request asks
    speaker_cache (and with it Redis) for its prompt."""
    t = np.arange(int(seconds * rate)) / rate
    x = 0.2 * np.sin(2 * np.pi * (110 + 7 * i) * t) + 0.05 * np.sin(2 * np.pi * (330 + 3 * i) * t)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisProcess(tmp_path_factory.mktemp("redis-aof"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def outage_stack(redis_server, snapshot_root: Path, tmp_path_factory):
    """(Base stack on the AOF Redis, URL of a CustomVoice gateway sharing its code2wav)."""
    base = tiny_snapshot(snapshot_root, "base")
    custom = tiny_snapshot(snapshot_root, "custom_voice")
    config = StackConfig.on_free_ports(
        code2wav_replicas=1,
        model=str(base),
        redis_url=redis_server.url,
        startup_timeout_s=300.0,
        drain_seconds=1.0,
        log_dir=tmp_path_factory.mktemp("outage-logs"),
        # Health that follows the stages within a second (defaults: 5 s and 2 s). The capacity model
        # is off: on a busy CI machine the tiny model's CPU steps measure slower than a frame, so it
        # would allow one stream and refuse the load's second (these tests are about outages; the
        # capacity tests are tests/services/talker/test_capacity.py).
        extra_args={
            "gateway": ("--talker-refresh-s", "0.3"),
            "talker": (
                "--health-interval-s",
                "0.3",
                "--admission-max-duty",
                "0",
                "--admission-max-load",
                "0",
            ),
        },
    )
    stack: Stack = start_stack(config)
    talker_port, http_port = free_port(), free_port()
    extra = [
        start_service(
            talker_spec(config, str(custom), name="talker-custom", port=talker_port, metrics_port=0),
            config.log_dir,
        ),
        start_service(
            gateway_spec(
                config,
                name="gateway-custom",
                talker_port=talker_port,
                http_port=http_port,
                grpc_port=free_port(),
                metrics_port=0,
                talker_metrics_port=0,
            ),
            config.log_dir,
        ),
    ]
    try:
        for proc in extra:
            wait_serving(proc, config.startup_timeout_s)
        yield stack, f"http://{config.host}:{http_port}"
    finally:
        stop_services(extra, 10.0)
        stack.stop(grace=10.0)


class Load:
    """Inline-clip requests (each a new clip) and preset requests in a loop, every outcome kept."""

    def __init__(self, base_url: str, custom_url: str):
        self.base_url, self.custom_url = base_url, custom_url
        self.results: list[tuple[float, str, int, str]] = []  # (time, kind, status, detail)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _run(self, kind: str, offset: int) -> None:
        i = offset
        with httpx.Client(timeout=60) as client:
            if kind == "preset":
                voices = client.get(f"{self.custom_url}/v1/audio/voices").json()["voices"]
                speaker = next(v["name"] for v in voices if v["kind"] == "preset")
            while not self._stop.is_set():
                i += 1
                if kind == "inline":
                    url = f"{self.base_url}/v1/audio/speech"
                    body = {
                        "input": f"Line {i}.",
                        "voice": "inline",
                        "ref_audio": _clip(i),
                        "ref_text": REF_TEXT,
                    }
                else:
                    url = f"{self.custom_url}/v1/audio/speech"
                    body = {"input": f"Preset line {i}.", "voice": speaker}
                body.update(max_new_tokens=3, seed=i, response_format="pcm", stream=False)
                try:
                    r = client.post(url, json=body)
                    status, detail = r.status_code, "" if r.status_code == 200 else r.text[:200]
                    if status == 200 and len(r.content) != 3 * 1920 * 2:
                        status, detail = -1, f"{len(r.content)} bytes of audio"
                except httpx.HTTPError as exc:
                    status, detail = -2, repr(exc)
                self.results.append((time.monotonic(), kind, status, detail))

    def __enter__(self) -> Load:
        for kind, offset in (("inline", 0), ("inline", 10_000), ("preset", 0)):
            t = threading.Thread(target=self._run, args=(kind, offset), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def count(self, kind: str, since: float = 0.0, until: float = float("inf")) -> int:
        return sum(1 for t, k, _, _ in self.results if k == kind and since <= t <= until)


def _health(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _create_voice(client: httpx.Client, name: str, i: int) -> httpx.Response:
    return client.post("/v1/audio/voices", json={"name": name, "audio": _clip(i), "ref_text": REF_TEXT})


def test_redis_outage_degrades_only_the_voice_api_and_loses_no_voice(outage_stack, redis_server):
    stack, custom_url = outage_stack
    with httpx.Client(base_url=stack.http_url, timeout=30) as c:
        names = [f"durable-{i}" for i in range(3)]
        for i, name in enumerate(names):
            assert _create_voice(c, name, 500 + i).status_code == 201
        with Load(stack.http_url, custom_url) as load:
            assert poll(lambda: load.count("inline") >= 4 and load.count("preset") >= 2, timeout=60)

            redis_server.stop()
            down_at = time.monotonic()
            # The voice API fails fast and clearly; readiness (the probe that routes traffic) holds.
            assert poll(lambda: c.get("/v1/audio/voices").status_code == 503, timeout=15)
            outage_answers = []
            while time.monotonic() - down_at < 4.0:
                outage_answers.append(
                    (
                        c.get("/readyz").status_code,
                        c.get("/livez").status_code,
                        c.get("/v1/audio/voices").status_code,
                        _create_voice(c, "during-outage", 900).status_code,
                        c.get(f"/v1/audio/voices/{names[0]}").status_code,
                    )
                )
                time.sleep(0.2)
            # The gateway learns of the outage at speaker_cache's next health round: wait for it.
            poll(lambda: c.get("/readyz").json().get("status") == "degraded", timeout=10)
            ready_json = c.get("/readyz").json()
            # speaker_cache: unready (its store is gone), alive (a restart would not bring Redis back).
            cache = stack["speaker_cache"].spec.grpc_address
            cache_health = (_health(cache), _health(cache, LIVENESS))
            up_at = time.monotonic()
            redis_server.start()

            # redis-py reconnects by itself: the voice API comes back without a restart.
            assert poll(lambda: c.get("/v1/audio/voices").status_code == 200, timeout=20)
            back_at = time.monotonic()
            assert poll(lambda: load.count("inline", since=back_at) >= 2, timeout=30)
        assert {a[:2] for a in outage_answers} == {(200, 200)}, outage_answers
        assert {a[2:] for a in outage_answers} == {(503, 503, 503)}, outage_answers
        assert ready_json["status"] == "degraded", ready_json
        assert cache_health == ("NOT_SERVING", "SERVING"), cache_health
        assert ready_json["stages"]["talker"] == "SERVING", ready_json

        failures = [r for r in load.results if r[2] != 200]
        assert not failures, failures[:5]
        # The load ran through the outage, not around it.
        assert load.count("inline", down_at, up_at) >= 3, load.results
        assert load.count("preset", down_at, up_at) >= 1, load.results

        # The append-only file brought every voice back, and they still speak.
        listed = {v["name"] for v in c.get("/v1/audio/voices").json()["voices"]}
        assert set(names) <= listed and "during-outage" not in listed, listed
        assert redis_server.aof_files(), "no append-only file was written"
        r = c.post(
            "/v1/audio/speech",
            json={"input": "Back again.", "voice": names[0], "max_new_tokens": 3, "response_format": "pcm"},
        )
        assert r.status_code == 200 and len(r.content) == 3 * 1920 * 2, r.text[:200]
        assert _create_voice(c, "after-outage", 901).status_code == 201


def _kill_and_restart(stack: Stack, name: str, while_down) -> None:
    """SIGKILL `name`, run `while_down()`, start it again with the same flags (same address)."""
    old = stack[name]
    old.popen.kill()
    old.popen.wait(10)
    try:
        while_down()
    finally:
        new = start_service(old.spec, stack.config.log_dir)
        stack.processes[stack.processes.index(old)] = new
        wait_serving(new, stack.config.startup_timeout_s)


def test_gateway_and_talker_health_follow_a_killed_stage_and_its_return(outage_stack):
    stack, _ = outage_stack
    gateway, talker = stack.grpc_address, stack["talker"].spec.grpc_address
    body = {"input": "Still here?", "voice": "x", "ref_audio": _clip(1), "x_vector_only_mode": True,
            "max_new_tokens": 3, "response_format": "pcm"}  # fmt: skip

    def serving() -> bool:
        return (
            httpx.get(f"{stack.http_url}/readyz", timeout=5).status_code == 200
            and _health(gateway) == "SERVING"
        )

    def not_serving() -> bool:
        return (
            httpx.get(f"{stack.http_url}/readyz", timeout=5).status_code == 503
            and _health(gateway) == "NOT_SERVING"
        )

    assert poll(serving, timeout=10)

    def talker_down() -> None:
        assert poll(not_serving, timeout=10)
        assert _health(gateway, LIVENESS) == "SERVING"  # unready, not dead
        assert httpx.get(f"{stack.http_url}/livez", timeout=5).status_code == 200

    _kill_and_restart(stack, "talker", talker_down)
    # A stack that says ready serves: readiness is the talker pool's view, the one a new stream is
    # placed from (it once said ready over another channel while the pool's still waited out its
    # reconnect backoff, and this POST got 503). So: wait (bounded) for ready, then speak at once.
    assert poll(serving, timeout=15)
    assert httpx.post(f"{stack.http_url}/v1/audio/speech", json=body, timeout=60).status_code == 200

    def code2wav_down() -> None:
        # The talker cannot decode without a replica: it says so, and the gateway follows.
        assert poll(lambda: _health(talker) == "NOT_SERVING", timeout=10)
        assert _health(talker, LIVENESS) == "SERVING"
        assert poll(not_serving, timeout=10)

    _kill_and_restart(stack, "code2wav-0", code2wav_down)
    assert poll(lambda: _health(talker) == "SERVING", timeout=15)
    assert poll(serving, timeout=15)
    assert httpx.post(f"{stack.http_url}/v1/audio/speech", json=body, timeout=60).status_code == 200


def test_the_launchers_supervisor_restarts_a_killed_stage_and_the_stack_serves_again(outage_stack):
    """`make run`'s supervision (services/supervisor.py, as the launcher's main loop runs it): a
    stage killed with SIGKILL is started again on its address, the gateway says ready again, and a
    request is served, with nobody restarting anything by hand."""
    from services.supervisor import RestartPolicy, Supervisor

    stack, _ = outage_stack
    body = {"input": "Back again?", "voice": "x", "ref_audio": _clip(2), "x_vector_only_mode": True,
            "max_new_tokens": 3, "response_format": "pcm"}  # fmt: skip
    lines: list[str] = []
    supervisor = Supervisor(stack, RestartPolicy(first_backoff_s=0.2), say=lines.append)
    done = threading.Event()

    def loop() -> None:
        while not done.wait(0.2):
            supervisor.check()

    watcher = threading.Thread(target=loop, daemon=True)
    watcher.start()
    try:
        for name in ("code2wav-0", "speaker_cache"):
            old = stack[name]
            old.popen.kill()
            old.popen.wait(10)
            assert poll(lambda name=name: supervisor.restarted.count(name) == 1, timeout=120), lines
            assert stack[name] is not old and stack[name].alive()
        assert any("code2wav-0 exited with code -9; restarting it" in line for line in lines)
        assert poll(lambda: httpx.get(f"{stack.http_url}/readyz", timeout=5).status_code == 200, timeout=20)
        assert httpx.post(f"{stack.http_url}/v1/audio/speech", json=body, timeout=60).status_code == 200
    finally:
        done.set()
        watcher.join(5)
