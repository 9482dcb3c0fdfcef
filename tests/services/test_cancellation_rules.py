"""Two rules that keep a cancelled stream from running on, checked over the services' code:

- no `asyncio.wait_for`: on Python 3.11 it swallows a cancel that lands as its inner task
  finishes (the HTTP pump of a client that had left streamed on for the stream's whole length);
  `asyncio.timeout` does not;
- an async generator that re-yields another's items closes it with `contextlib.aclosing`, so that
  closing the outer one runs the inner one's cleanup (cancel the call, free the slot) within the
  close, not whenever the garbage collector finds it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = sorted(p for d in ("services", "qtts") for p in (ROOT / d).rglob("*.py"))


def _wait_for_calls(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "wait_for"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "asyncio"
    ]


def _unclosed_reyields(tree: ast.AST) -> list[int]:
    """`async for x in f(...): yield x` inside an async generator, iterating a call's result
    directly (an async generator made on the spot) rather than a name bound by aclosing."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if (
                isinstance(node, ast.AsyncFor)
                and isinstance(node.iter, ast.Call)
                and any(isinstance(n, ast.Yield) for stmt in node.body for n in ast.walk(stmt))
            ):
                found.append(node.lineno)
    return found


def test_the_code_is_read():
    assert len(CODE) > 100
    assert _wait_for_calls(ast.parse("import asyncio\nasync def f():\n    await asyncio.wait_for(g(), 1)\n"))
    assert _unclosed_reyields(ast.parse("async def f():\n    async for x in g():\n        yield x\n"))
    closed = "async def f():\n    async with aclosing(g()) as xs:\n        async for x in xs:\n            yield x\n"
    assert not _unclosed_reyields(ast.parse(closed))


def test_no_asyncio_wait_for_in_the_services():
    found = {
        str(p.relative_to(ROOT)): lines for p in CODE if (lines := _wait_for_calls(ast.parse(p.read_text())))
    }
    assert not found, f"asyncio.wait_for can swallow a cancel on Python 3.11; use asyncio.timeout: {found}"


def test_async_generators_close_what_they_re_yield():
    found = {
        str(p.relative_to(ROOT)): lines
        for p in CODE
        if (lines := _unclosed_reyields(ast.parse(p.read_text())))
    }
    assert not found, f"re-yielded async generators not closed with contextlib.aclosing: {found}"
