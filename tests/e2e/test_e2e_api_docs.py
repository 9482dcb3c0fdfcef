"""The examples of docs/api.md (every python and bash block) and the README's python blocks run as
written against the real stack, and the documented field tables name every field the typed
request models accept."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import wave
from pathlib import Path

import httpx
import pytest
from e2e_helpers import FRAME_BYTES, REF_B64, REF_WAV

from services.gateway.http_request import SpeechRequest, StreamingSessionConfig

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```$", re.S | re.M)


def _blocks(path: Path, kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(kind, code) for kind, code in BLOCK.findall(path.read_text()) if kind in kinds]


def _on_stack(code: str, stack) -> str:
    """The examples' default addresses replaced by the test stack's."""
    http = stack.http_url.removeprefix("http://")
    return code.replace("127.0.0.1:8000", http).replace("127.0.0.1:50051", stack.grpc_address)


@pytest.fixture
def workdir(stack, tmp_path) -> Path:
    """A folder holding the examples' input clip, with the voice `demo` that `make run` creates."""
    (tmp_path / "my_voice.wav").write_bytes(REF_WAV)
    r = httpx.post(
        f"{stack.http_url}/v1/audio/voices",
        timeout=60,
        json={"name": "demo", "audio_sample": REF_B64, "x_vector_only_mode": True},
    )
    assert r.status_code in (201, 409), r.text
    return tmp_path


def _run(kind: str, code: str, cwd: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'qtts' / '_gen'}{os.pathsep}{ROOT}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    argv = [sys.executable, "-c", code] if kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (
        f"{kind} example failed:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )


def test_api_md_examples_run_as_written(stack, workdir):
    blocks = _blocks(API_MD, ("python", "bash"))
    assert len(blocks) >= 6
    for kind, code in blocks:
        _run(kind, _on_stack(code, stack), workdir)
    # No length field in the examples: the tiny model's declared default length ends them.
    wav = (workdir / "hello.wav").read_bytes()  # streamed: its size fields are 0xFFFFFFFF
    with wave.open(io.BytesIO(wav)) as w:
        assert w.getframerate() == 24000 and len(wav) > 44 and (len(wav) - 44) % FRAME_BYTES == 0
    size = (workdir / "hello.pcm").stat().st_size
    assert size > 0 and size % FRAME_BYTES == 0
    assert (workdir / "mine.mp3").stat().st_size > 0
    for name in ("synthesize.json", "streamed.json"):
        text = (workdir / name).read_text()
        assert '"audio"' in text and ("numFrames" in text or "num_frames" in text), text[:500]


def test_readme_examples_run_as_written(stack, workdir):
    """Every python block, and every bash block that talks to the stack (curl, grpcurl); the
    others set up or start a stack themselves (make, the launcher on a GPU)."""
    blocks = [
        (kind, code)
        for kind, code in _blocks(ROOT / "README.md", ("python", "bash"))
        if kind == "python" or code.lstrip().startswith(("curl ", "grpcurl "))
    ]
    assert sum(kind == "bash" for kind, _ in blocks) >= 3 and any(kind == "python" for kind, _ in blocks)
    for kind, code in blocks:
        _run(kind, _on_stack(code, stack), workdir)
    size = (workdir / "mine.pcm").stat().st_size  # the voice clone from a clip in the request
    assert size > 0 and size % FRAME_BYTES == 0


def test_the_field_tables_name_every_field():
    doc = API_MD.read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    missing = (
        (set(SpeechRequest.model_fields) | set(StreamingSessionConfig.model_fields)) - documented - {"type"}
    )
    assert not missing, f"fields missing from docs/api.md: {sorted(missing)}"
