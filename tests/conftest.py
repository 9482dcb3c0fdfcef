"""Suite-wide settings and fixtures shared by several test folders."""

from __future__ import annotations

import ast
import functools
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


# Parallel runs (`make test`: pytest -n auto --dist loadgroup). The scheduler below keeps each test
# module on one worker, so a module-scoped fixture (a variant talker, a fresh venv) starts once, as in
# a serial run, and sends every module that uses the end-to-end session stack (tests/e2e/conftest.py
# `stack`, with its Redis) to one worker, so that stack starts once a run instead of once a worker.
# Every other session fixture builds into the worker's own temporary folder (tmp_path_factory) and
# is cheap enough to build on each worker.
#
# xdist's own loadgroup cannot do this under pytest 9: it marks a group by appending "@group" to
# `item._nodeid`, which pytest 9 no longer reads (nodeids come from `item._id`), so every test would
# be scheduled on its own and module fixtures would start again on every worker and after every
# switch between modules. The scheduler runs in the controller, which collects nothing, so it tells
# the session stack's modules from their source (`module_uses_session_stack`); the workers check
# that against the fixtures pytest resolved (pytest_collection_modifyitems) and stop the run when
# a module uses the stack where its source does not say so.
SHARED_STACK_GROUP = "e2e-session-stack"
SESSION_STACK_FIXTURES = frozenset({"stack", "variant_gateways"})  # variant_gateways needs stack


@functools.cache
def module_uses_session_stack(path: Path) -> bool:
    """Whether a test module under tests/e2e/ asks for `stack` or `variant_gateways`: as an argument
    of a test or of a fixture, or in a usefixtures mark (a helper's argument of that name is not a
    request). Elsewhere (the talker and deploy tests) a fixture called `stack` is a module's own."""
    if "e2e" not in path.parts or not path.is_file():
        return False
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            requests = node.name.startswith("test") or any(
                "fixture" in ast.unparse(d) for d in node.decorator_list
            )
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if requests and {a.arg for a in args} & SESSION_STACK_FIXTURES:
                return True
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("usefixtures"):
            if {a.value for a in node.args if isinstance(a, ast.Constant)} & SESSION_STACK_FIXTURES:
                return True
    return False


def scheduling_scope(rootpath: Path, nodeid: str) -> str:
    """The unit the parallel run schedules `nodeid` in: its module, or the shared stack's group."""
    module = nodeid.split("::", 1)[0]
    return SHARED_STACK_GROUP if module_uses_session_stack(rootpath / module) else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a venv without xdist still runs
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None  # --dist load, loadfile, ...: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_scope(config.rootpath, nodeid)

    return ModuleScheduling(config, log)


def uses_session_stack(item) -> bool:
    """Whether pytest resolved the e2e session `stack` for `item` (directly or through
    `variant_gateways`): a session-scoped fixture of that name."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("stack", ())
    return bool(defs) and defs[-1].scope == "session"


def pytest_collection_modifyitems(config, items):
    resolved: dict[str, bool] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        resolved[module] = resolved.get(module, False) or uses_session_stack(item)
    # One way only: a run of some of a module's tests may leave out the ones that use the stack.
    wrong = sorted(
        m for m, uses in resolved.items() if uses and not module_uses_session_stack(config.rootpath / m)
    )
    if wrong:
        raise pytest.UsageError(
            "tests/conftest.py: module_uses_session_stack disagrees with the fixtures pytest resolved for "
            + ", ".join(wrong)
            + ": name the e2e session stack's fixtures (SESSION_STACK_FIXTURES) where the module uses them"
        )


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
