"""`StartupPhases`: each phase of a service's start-up logged and exported, SERVING timed from the
process's start."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from qtts.serving.startup import StartupPhases, process_age_s


def test_phases_are_logged_and_exported(caplog):
    registry = CollectorRegistry()
    startup = StartupPhases(registry, "code2wav")
    caplog.set_level(logging.INFO, logger="qtts.serving.startup")
    with startup.phase("load the decoder"):
        time.sleep(0.02)
    startup.record_all({"load the model": 1.5, "warm up": 0.25}, prefix="engine: ")

    def value(phase):
        return registry.get_sample_value("tts_startup_seconds", {"service": "code2wav", "phase": phase})

    assert 0.02 <= value("load the decoder") < 5
    assert value("engine: load the model") == 1.5 and value("engine: warm up") == 0.25
    assert "start-up: load the decoder took 0.0 s" in caplog.text
    assert "start-up: engine: load the model took 1.5 s" in caplog.text
    assert startup.phases == {
        "load the decoder": value("load the decoder"),
        "engine: load the model": 1.5,
        "engine: warm up": 0.25,
    }


def test_a_phase_that_fails_is_not_recorded():
    startup = StartupPhases(None, "talker")
    with pytest.raises(RuntimeError), startup.phase("load the model"):
        raise RuntimeError("no such snapshot")
    assert startup.phases == {}


def test_serving_counts_from_the_process_start_and_only_once():
    registry = CollectorRegistry()
    startup = StartupPhases(registry, "gateway")
    age = process_age_s()
    assert age is not None and age > 0  # this test process started before this line
    startup.serving()
    first = registry.get_sample_value("tts_startup_seconds", {"service": "gateway", "phase": "serving"})
    assert first >= age
    time.sleep(0.01)
    startup.serving()
    assert (
        registry.get_sample_value("tts_startup_seconds", {"service": "gateway", "phase": "serving"}) == first
    )


def test_process_age_of_a_fresh_process_is_small_and_grows():
    code = (
        "import time; from qtts.serving.startup import process_age_s; a = process_age_s(); "
        "time.sleep(0.3); b = process_age_s(); print(a, b)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    a, b = map(float, out.split())
    assert 0 < a < 30
    assert b - a >= 0.25
