"""The gateway's readiness follows a stage's death within a second, through the real processes,
with the default health settings (issue 28).

A stack of its own (one code2wav replica, so its death leaves the talker nothing to decode on)
under the launcher's supervisor, as `make run` runs it. `/health` is polled every 50 ms:
- code2wav killed with SIGKILL: `/health` leaves 200 within 1 s, and is 200 again once the
  supervisor has restarted it, and a request is served;
- speaker_cache killed: within 1 s `/health` says `degraded` (still 200: synthesis with inline
  clips goes on without it, docs/api.md), and `ok` again after its restart;
- code2wav stopped (SIGSTOP) for 2 s, a live process that answers nothing, as a replica under
  GPU load may: `/health` stays 200 throughout.

Before the change a dead code2wav was seen after the talker's health round (2 s), the check's
1 s wait for a reconnect and two empty rounds more (about 5-7 s).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from e2e_helpers import REF_B64, poll, running_stack, tiny_stack_config

from services.supervisor import RestartPolicy, Supervisor

pytestmark = pytest.mark.e2e

FOLLOW_S = 1.0  # the bound: readiness follows a stage's death within this
BODY = {"input": "Back again?", "ref_audio": REF_B64, "x_vector_only_mode": True,
        "max_new_tokens": 3, "response_format": "pcm"}  # fmt: skip


class HealthTrace:
    """GET /health every 50 ms in a thread: (time, status code, body status) of each answer."""

    def __init__(self, url: str):
        self.url = url
        self.seen: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                try:
                    r = client.get(self.url + "/health")
                    self.seen.append((time.monotonic(), r.status_code, r.json().get("status", "")))
                except httpx.HTTPError:
                    self.seen.append((time.monotonic(), 0, "unreachable"))
                time.sleep(0.05)

    def first_after(self, since: float, test) -> float | None:
        """Seconds from `since` to the first answer after it that passes `test(code, status)`."""
        for t, code, status in list(self.seen):
            if t > since and test(code, status):
                return t - since
        return None

    def all_after(self, since: float, test) -> bool:
        return all(test(code, status) for t, code, status in list(self.seen) if t > since)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


@pytest.fixture(scope="module")
def supervised(redis_url, snapshot_root, tmp_path_factory):
    """A stack with the default health settings, its supervisor checking every 0.2 s, and a trace."""
    config = tiny_stack_config(snapshot_root, tmp_path_factory.mktemp("readiness-logs"), redis_url=redis_url)
    with running_stack(config) as stack:
        lines: list[str] = []
        supervisor = Supervisor(stack, RestartPolicy(first_backoff_s=0.2), say=lines.append)
        done = threading.Event()

        def supervise() -> None:  # the launcher's main loop, as `make run` runs it
            while not done.wait(0.2):
                supervisor.check()

        watcher = threading.Thread(target=supervise, daemon=True)
        watcher.start()
        trace = HealthTrace(stack.http_url)
        try:
            assert poll(lambda: trace.seen and trace.seen[-1][1:] == (200, "ok"), timeout=30), trace.seen[-5:]
            yield stack, supervisor, trace
        finally:
            trace.stop()
            done.set()
            watcher.join(10)


def _kill(stack, name: str) -> float:
    proc = stack[name]
    killed = time.monotonic()
    proc.popen.kill()
    proc.popen.wait(10)
    return killed


def test_a_live_code2wav_that_answers_nothing_for_2_s_keeps_the_gateway_ready(supervised):
    stack, _, trace = supervised
    pid = stack["code2wav-0"].popen.pid
    since = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(6.0)  # past two health rounds after the stall
    assert trace.all_after(since, lambda code, status: code == 200), [s for s in trace.seen if s[0] > since]
    assert httpx.post(stack.http_url + "/v1/audio/speech", json=BODY, timeout=60).status_code == 200


def test_a_killed_code2wav_makes_the_gateway_unready_within_a_second_until_restarted(supervised):
    stack, supervisor, trace = supervised
    killed = _kill(stack, "code2wav-0")
    assert poll(lambda: trace.first_after(killed, lambda code, _: code == 503) is not None, timeout=15)
    took = trace.first_after(killed, lambda code, _: code == 503)
    print(f"code2wav killed: /health 503 after {took * 1000:.0f} ms")
    assert took < FOLLOW_S, took
    assert poll(lambda: supervisor.restarted.count("code2wav-0") == 1, timeout=120)
    restarted = time.monotonic()
    assert poll(
        lambda: trace.first_after(restarted, lambda code, s: (code, s) == (200, "ok")) is not None, 30
    )
    print(
        f"code2wav restarted: /health 200 {trace.first_after(restarted, lambda c, s: c == 200) * 1000:.0f} ms later"
    )
    assert httpx.post(stack.http_url + "/v1/audio/speech", json=BODY, timeout=60).status_code == 200


def test_a_killed_speaker_cache_degrades_the_gateway_within_a_second_until_restarted(supervised):
    stack, supervisor, trace = supervised
    killed = _kill(stack, "speaker_cache")
    assert poll(lambda: trace.first_after(killed, lambda _, s: s == "degraded") is not None, timeout=15)
    took = trace.first_after(killed, lambda _, s: s == "degraded")
    print(f"speaker_cache killed: /health degraded after {took * 1000:.0f} ms")
    assert took < FOLLOW_S, took
    # Degraded is still ready: synthesis with an inline clip does not need speaker_cache.
    assert trace.all_after(killed, lambda code, _: code == 200)
    assert poll(lambda: supervisor.restarted.count("speaker_cache") == 1, timeout=120)
    restarted = time.monotonic()
    assert poll(
        lambda: trace.first_after(restarted, lambda code, s: (code, s) == (200, "ok")) is not None, 30
    )
    assert httpx.post(stack.http_url + "/v1/audio/speech", json=BODY, timeout=60).status_code == 200
