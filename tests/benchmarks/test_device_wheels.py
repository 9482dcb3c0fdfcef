"""benchmarks/device_wheels.py: the wheel list for the GPU machines, pinned by requirements.lock."""

from __future__ import annotations

import pytest

from benchmarks.device_wheels import AV_WHEELS, PROF_WHEELS, WHEELS, download_command, pins, requirements


def test_every_device_wheel_is_pinned_by_the_lock_file():
    reqs = requirements(WHEELS + AV_WHEELS + PROF_WHEELS)
    assert len(reqs) == len(WHEELS) + len(AV_WHEELS) + len(PROF_WHEELS)
    pinned = pins()
    assert f"grpcio-status=={pinned['grpcio-status']}" in reqs
    assert any(r.startswith("googleapis-common-protos==") for r in reqs)


def test_the_download_is_for_cpython_3_12_on_x86_64_wheels_only(tmp_path):
    cmd = download_command(("protobuf",), tmp_path)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd
    assert "--no-deps" in cmd and cmd[cmd.index("-d") + 1] == str(tmp_path)
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert platforms and all(p.endswith("x86_64") for p in platforms)


def test_a_name_the_lock_does_not_pin_is_an_error(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("protobuf==7.36.2\n# a comment\n")
    assert requirements(("Protobuf",), lock) == ["Protobuf==7.36.2"]
    with pytest.raises(SystemExit, match="no-such-package"):
        requirements(("protobuf", "no-such-package"), lock)
