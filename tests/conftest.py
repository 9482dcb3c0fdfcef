"""Suite-wide settings and fixtures shared by several test folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, the talker's fused Triton kernels run under Triton's interpreter (when triton is
# installed). Triton reads this when it is imported (its own library functions are decorated then),
# and `import torch._dynamo` imports it, so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# With two cores shared by the test process and the service subprocesses, intra-op threads only
# add contention for the tiny models used in tests.
torch.set_num_threads(1)


# Parallel runs (`make test`: pytest -n auto --dist loadgroup). Each test joins an xdist_group that
# keeps its whole module on one worker, so a module-scoped fixture (a variant talker, a stack of the
# module's own) starts once, as in a serial run. The modules that use the end-to-end session stack
# (tests/e2e/conftest.py `stack`, with its Redis) share one group, so that stack starts once per run
# instead of once per worker; every other session fixture builds into the worker's own temporary
# folder (tmp_path_factory) and is cheap enough to build on each worker.
SHARED_STACK_GROUP = "e2e-session-stack"


def uses_session_stack(item) -> bool:
    """Whether `item` needs the e2e session `stack` (directly or through `variant_gateways`); the
    talker and deploy tests have module fixtures of that name of their own."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("stack", ())
    return bool(defs) and defs[-1].scope == "session"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    shared: set[str] = set()
    for item in items:
        if uses_session_stack(item):
            shared.add(item.nodeid.split("::", 1)[0])
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(SHARED_STACK_GROUP if module in shared else module))


@pytest.fixture(scope="session")
def tiny_codec_dir(tmp_path_factory) -> Path:
    """A folder holding a tiny random `speech_tokenizer/` (seed 0) in the real layout."""
    from qtts.tiny_model.codec import write_tiny_speech_tokenizer

    root = tmp_path_factory.mktemp("codec")
    write_tiny_speech_tokenizer(root, seed=0)
    return root


@pytest.fixture(scope="session")
def tiny_codec_decoder(tiny_codec_dir):
    """Our `CodecDecoder` loaded from `tiny_codec_dir` (fp32, CPU)."""
    from qtts.model import load_codec_decoder

    return load_codec_decoder(tiny_codec_dir)


# The gRPC tests' helpers (tests/grpc_helpers.py), as fixtures for tests/qtts and tests/services.


@pytest.fixture
def grpc_host_factory():
    """The `running_host` context manager, as a fixture for tests that prefer injection."""
    from tests.grpc_helpers import running_host

    return running_host


@pytest.fixture
def free_tcp_port() -> int:
    from services.launcher import free_port

    return free_port()


@pytest.fixture
def fake_decoder():
    """A `FakeIncrementalDecoder` (tests/grpc_helpers.py): deterministic, cheap, observable."""
    from tests.grpc_helpers import FakeIncrementalDecoder

    return FakeIncrementalDecoder()


@pytest.fixture
def bidi_client():
    from tests.grpc_helpers import BidiClient

    return BidiClient


@pytest.fixture
def eventually():
    from tests.grpc_helpers import wait_until

    return wait_until
