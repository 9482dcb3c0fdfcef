"""docs/settings.md from the services' and the launcher's settings declarations (qtts/serving/settings.py):
one table per program with every flag, its env variables, default and help.

    python docs/settings_table.py --write   # rewrite docs/settings.md

tests/qtts/serving/test_settings.py fails when docs/settings.md is not what this prints.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "settings.md"
SERVICES = ("gateway", "talker", "code2wav", "speaker_cache", "aligner")
# Where each program declares its settings (`SETTINGS`).
MODULES = {**{name: f"services.{name}.config" for name in SERVICES}, "launcher": "services.launcher.settings"}

HEADER = """# Settings

Every setting of every service, generated from the declarations in `services/<name>/config.py`,
and of the launcher (`make run`), from `services/launcher/settings.py` (`python docs/settings_table.py
--write`; a test fails when this page is out of date). A flag wins over its env variables, which
are read in the order listed, and they over the default. A value that does not parse, or is not
one of the choices, stops the program with one line naming the flag and the env variable (exit
status 2).
"""


def render() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    parts = [HEADER]
    for name, module in MODULES.items():
        settings = importlib.import_module(module).SETTINGS
        parts.append(f"## {name}\n\n`{settings.prog}`\n\n{settings.table()}")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--write"]:
        DOC.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
