"""checkov over every rendering of the stack: no failed check that deploy/checkov-skips.txt does
not list with a reason, and no listed check that nothing fails any more.

checkov pins packages that clash with the main venv's, so it runs from its own venv
(`make checkov-env`, which make test does); without it the test is skipped, except in CI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_manifests import (
    OTHER_VALUES,
    ROOT,
    STACKS,
    chart,  # noqa: F401 - the module-scoped fixture
    render_chart,
    stack_docs,
)

SKIPS_FILE = ROOT / "deploy" / "checkov-skips.txt"


def checkov() -> str:
    for candidate in (
        os.environ.get("CHECKOV"),
        str(ROOT / ".venv-checkov" / "bin" / "checkov"),
        shutil.which("checkov"),
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    if os.environ.get("CI"):
        pytest.fail("checkov is not installed (make checkov-env), and CI requires the checkov test to run")
    pytest.skip("checkov is not installed: make checkov-env")


def skips() -> dict[str, str]:
    found = {}
    for line in SKIPS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            check, _, reason = line.partition(":")
            assert reason.strip(), f"{check}: no reason given"
            found[check.strip()] = reason.strip()
    return found


def failed_checks(path: Path) -> set[str]:
    res = subprocess.run(
        [checkov(), "-f", str(path), "--framework", "kubernetes", "--quiet", "--compact", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    reports = json.loads(res.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = set()
    for report in reports:
        assert report["summary"]["parsing_errors"] == 0, path.name
        assert report["summary"]["resource_count"] > 0, path.name
        failed |= {c["check_id"] for c in report["results"]["failed_checks"]}
    return failed


def test_checkov_finds_nothing_but_the_listed_exceptions(tmp_path, chart):  # noqa: F811
    renderings = {name: stack_docs(name, chart) for name in STACKS}
    renderings["helm-other-values"] = render_chart(chart, OTHER_VALUES)
    failed: dict[str, set[str]] = {}
    for name, docs in renderings.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        failed[name] = failed_checks(path)
    allowed = skips()
    unexpected = {name: sorted(ids - set(allowed)) for name, ids in failed.items() if ids - set(allowed)}
    assert not unexpected, f"checkov failures not in {SKIPS_FILE.name}: {unexpected}"
    stale = set(allowed) - set().union(*failed.values())
    assert not stale, f"{SKIPS_FILE.name} lists checks nothing fails any more: {sorted(stale)}"
