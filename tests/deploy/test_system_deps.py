"""`make test`'s system set-up (.ci/system-deps): nothing to do when redis-server and Chromium are
there; as root it apt-installs what is missing; otherwise it stops at once and prints the one command
that installs them. Each case runs the script with a PATH of stand-ins (`id`, `apt-get`, the tools)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_manifests import ROOT

SCRIPT = ROOT / ".ci" / "system-deps"
BASH = shutil.which("bash")


def _stand_in(folder: Path, name: str, body: str = "exit 0") -> None:
    path = folder / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


def _run(bin_dir: Path, *, uid: int) -> subprocess.CompletedProcess:
    _stand_in(bin_dir, "id", f'[ "$1" = -u ] && echo {uid}')
    env = {"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    return folder


def test_nothing_missing_does_nothing(bin_dir, tmp_path):
    _stand_in(bin_dir, "redis-server")
    _stand_in(bin_dir, "chromium")
    log = tmp_path / "apt.log"
    _stand_in(bin_dir, "apt-get", f'echo "$@" >> {log}')
    for uid in (0, 1000):
        done = _run(bin_dir, uid=uid)
        assert done.returncode == 0, done.stderr
        assert done.stdout == done.stderr == ""
    assert not log.exists()


@pytest.mark.parametrize(
    ("present", "missing"),
    [(["chromium"], ["redis-server"]), (["redis-server"], ["chromium"]), ([], ["redis-server", "chromium"])],
)
def test_not_root_stops_and_prints_the_install_command(bin_dir, tmp_path, present, missing):
    for name in present:
        _stand_in(bin_dir, name)
    log = tmp_path / "apt.log"
    _stand_in(bin_dir, "apt-get", f'echo "$@" >> {log}')
    done = _run(bin_dir, uid=1000)
    assert done.returncode == 1
    command = f"sudo sh -c 'apt-get update && apt-get install -y {' '.join(missing)}'"
    assert command in done.stderr.splitlines()[-1]
    assert not log.exists(), "installed without root"


def test_root_installs_what_is_missing_with_apt_get(bin_dir, tmp_path):
    _stand_in(bin_dir, "redis-server")
    log = tmp_path / "apt.log"
    # The stand-in apt-get "installs" chromium by dropping a stand-in for it beside itself.
    _stand_in(
        bin_dir,
        "apt-get",
        f'echo "$@" >> {log}; [ "$1" = install ] && printf "#!{BASH}\\n" > {bin_dir}/chromium; exit 0',
    )
    done = _run(bin_dir, uid=0)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["update -qq", "install -y -qq chromium"]
    assert (bin_dir / "chromium").exists()


def test_root_without_apt_get_says_what_to_install(bin_dir):
    done = _run(bin_dir, uid=0)
    assert done.returncode == 1
    assert "redis-server chromium" in done.stderr


def test_make_test_runs_the_system_set_up_first_and_ci_is_make_test():
    makefile = (ROOT / "Makefile").read_text()
    test_rule = next(line for line in makefile.splitlines() if line.startswith("test:"))
    prerequisites = test_rule.split(":", 1)[1].split()
    assert prerequisites[0] == "system-deps", "the system set-up must stop make test before any pip install"
    assert "checkov-env" in prerequisites
    assert "bash .ci/system-deps" in makefile
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip()
        and not line.startswith("#")
        and not line.startswith("set ")
        and not line.startswith("cd ")
    ]
    assert ci == ["make test"]
