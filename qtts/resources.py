"""Where the files the code reads live: a source checkout or an installed package.

In a checkout the protos and model configs are the repository's `protos/` and `configs/`, and
generated or built state (stubs, the tiny snapshot, logs) goes into the checkout. An installed
wheel carries copies under `qtts/_data/` (and pre-built stubs in `qtts/_gen/`, see setup.py), and
its state goes to `$QTTS_HOME`, else `$XDG_CACHE_HOME/qtts`, else `~/.cache/qtts`: site-packages
may be read-only.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent
IN_CHECKOUT = (SOURCE_ROOT / "pyproject.toml").is_file() and (SOURCE_ROOT / "protos").is_dir()
PACKAGED_DATA = PACKAGE_DIR / "_data"

PROTOS_DIR = SOURCE_ROOT / "protos" if IN_CHECKOUT else PACKAGED_DATA / "protos"
CONFIGS_DIR = SOURCE_ROOT / "configs" if IN_CHECKOUT else PACKAGED_DATA / "configs"


def state_dir() -> Path:
    """Writable home of built state: the checkout, or a per-user cache for an installed package."""
    if IN_CHECKOUT:
        return SOURCE_ROOT
    if os.environ.get("QTTS_HOME"):
        return Path(os.environ["QTTS_HOME"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "qtts"
