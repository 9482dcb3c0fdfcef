"""tests/conftest.py's parallel scheduling: which modules share the end-to-end session stack."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SHARED_STACK_GROUP, module_uses_session_stack, scheduling_scope

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("source", "shared"),
    [
        ("def test_a(stack):\n    pass\n", True),
        ("async def test_a(variant_gateways, tmp_path):\n    pass\n", True),
        ("import pytest\n\n@pytest.fixture\ndef page(stack):\n    return stack\n", True),
        ("import pytest\n\npytestmark = pytest.mark.usefixtures('stack')\n", True),
        # A helper's argument called stack, or a stack the test starts itself, is not the session's.
        ("def _kill(stack):\n    pass\n\ndef test_a():\n    stack = object()\n", False),
        ("def test_a(redis_url):\n    pass\n", False),
    ],
)
def test_a_module_shares_the_stack_when_a_test_or_fixture_asks_for_it(tmp_path, source, shared):
    module = tmp_path / "tests" / "e2e" / "test_x.py"
    module.parent.mkdir(parents=True)
    module.write_text(source)
    assert module_uses_session_stack(module) is shared
    expected = SHARED_STACK_GROUP if shared else "tests/e2e/test_x.py"
    assert scheduling_scope(tmp_path, "tests/e2e/test_x.py::test_a[1]") == expected


def test_outside_e2e_a_stack_fixture_is_the_modules_own():
    # tests/services/talker/test_voice_resolution.py has a module fixture called stack of its own.
    nodeid = "tests/services/talker/test_voice_resolution.py::test_x"
    assert scheduling_scope(ROOT, nodeid) == "tests/services/talker/test_voice_resolution.py"
    assert scheduling_scope(ROOT, "tests/e2e/test_e2e_openai_sdk.py::test_y") == SHARED_STACK_GROUP
    assert scheduling_scope(ROOT, "tests/e2e/test_e2e_tls.py::test_z") == "tests/e2e/test_e2e_tls.py"
