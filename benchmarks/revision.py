"""The code revision a benchmark records: `$REVISION` when set (a copy of the tree run elsewhere,
e.g. on a lent GPU machine whose `.git` is stale), else `git rev-parse` of this checkout with
`-dirty` when tracked files differ from it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def git_revision() -> str:
    explicit = os.environ.get("REVISION", "").strip()
    if explicit:
        return explicit
    rev = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    return f"{rev}-dirty" if _git("status", "--porcelain", "--untracked-files=no") else rev
