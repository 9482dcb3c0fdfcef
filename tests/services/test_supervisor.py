"""The launcher's supervisor on fake processes and a fake clock: a dead service is restarted after
a doubling back-off, a restart that fails is tried again, and past the limit the stack stops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.launcher import StartupError
from services.supervisor import RestartPolicy, Supervisor


class FakeProc:
    def __init__(self, name: str):
        self.name = name
        self.dead = False
        self.popen = SimpleNamespace(returncode=None)

    def alive(self) -> bool:
        return not self.dead

    def die(self, code: int = -9) -> None:
        self.dead, self.popen.returncode = True, code

    def log_tail(self, lines: int = 40) -> str:
        return f"last lines of {self.name}"


class FakeStack:
    def __init__(self, *names: str):
        self.processes = [FakeProc(n) for n in names]
        self.restarts: list[tuple[str, float]] = []
        self.fail_next = 0

    def __getitem__(self, name):
        return next(p for p in self.processes if p.name == name)

    def restart(self, name: str, grace: float = 10.0):
        self.restarts.append((name, clock.now))
        if self.fail_next:
            self.fail_next -= 1
            raise StartupError(f"{name} exited with code 1 before it was SERVING")
        i = self.processes.index(self[name])
        self.processes[i] = FakeProc(name)
        return self.processes[i]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


clock = Clock()


@pytest.fixture(autouse=True)
def reset_clock():
    clock.now = 0.0


def test_a_dead_service_is_restarted_after_its_back_off_and_the_others_are_left_alone():
    stack = FakeStack("speaker_cache", "code2wav-0", "talker", "gateway")
    lines: list[str] = []
    sup = Supervisor(stack, RestartPolicy(first_backoff_s=0.5), clock=clock, say=lines.append)
    assert sup.check() is None and stack.restarts == []
    stack["code2wav-0"].die()
    assert sup.check() is None and stack.restarts == []  # scheduled, not yet due
    assert "code2wav-0 exited with code -9; restarting it in 0.5 s" in lines[0]
    clock.now = 0.6
    assert sup.check() is None
    assert stack.restarts == [("code2wav-0", 0.6)] and stack["code2wav-0"].alive()
    assert sup.restarted == ["code2wav-0"] and lines[-1] == "code2wav-0 is SERVING again"
    assert all(p.alive() for p in stack.processes)


def test_the_back_off_doubles_a_failed_restart_is_retried_and_past_the_limit_the_stack_stops():
    stack = FakeStack("talker", "gateway")
    lines: list[str] = []
    policy = RestartPolicy(max_restarts=3, window_s=300, first_backoff_s=1.0, max_backoff_s=30)
    sup = Supervisor(stack, policy, clock=clock, say=lines.append)
    stack.fail_next = 1
    stack["talker"].die()
    sup.check()  # due at 1.0
    clock.now = 1.0
    assert sup.check() is None  # the restart fails: counted, and tried again
    assert "talker did not come back" in lines[-1]
    stack["talker"].die(1)  # the fake's process stays dead after a failed start
    sup.check()  # second restart due after 2 s
    clock.now = 2.9
    sup.check()
    assert len(stack.restarts) == 1
    clock.now = 3.0
    sup.check()
    assert stack.restarts[-1] == ("talker", 3.0) and stack["talker"].alive()
    stack["talker"].die()
    sup.check()  # third, after 4 s
    clock.now = 7.0
    sup.check()
    assert [t for _, t in stack.restarts] == [1.0, 3.0, 7.0]
    stack["talker"].die()
    assert sup.check() == "talker"  # three restarts within 300 s: stop
    assert "after 3 restarts in 300 s; stopping the stack" in lines[-1]
    assert policy.backoff_s(10) == 30


def test_restarts_older_than_the_window_no_longer_count():
    stack = FakeStack("gateway")
    sup = Supervisor(
        stack, RestartPolicy(max_restarts=1, window_s=60, first_backoff_s=0), clock=clock, say=print
    )
    stack["gateway"].die()
    sup.check()
    assert stack.restarts == [("gateway", 0.0)]
    clock.now = 61.0
    stack["gateway"].die()
    assert sup.check() is None and len(stack.restarts) == 2  # the first is out of the window


def test_max_restarts_zero_stops_at_the_first_death_as_before():
    stack = FakeStack("talker")
    sup = Supervisor(stack, RestartPolicy(max_restarts=0), clock=clock, say=lambda _: None)
    stack["talker"].die()
    assert sup.check() == "talker" and stack.restarts == []


def test_the_launcher_flag_reaches_the_stack_config():
    from services.launcher import config_from_args

    assert config_from_args([]).max_restarts == 5
    assert config_from_args(["--max-restarts", "0"]).max_restarts == 0
    with pytest.raises(SystemExit):
        config_from_args(["--max-restarts", "-1"])


def test_the_launcher_says_who_can_use_the_stack():
    from services.launcher import StackConfig, access_note

    assert access_note(StackConfig()).startswith("open: no API keys") and "loopback" in access_note(
        StackConfig()
    )
    assert access_note(StackConfig(host="0.0.0.0")).startswith("WARNING: open on 0.0.0.0")
    keyed = StackConfig(extra_args={"gateway": ("--api-keys-file", "/k")})
    assert access_note(keyed).startswith("API keys required")
