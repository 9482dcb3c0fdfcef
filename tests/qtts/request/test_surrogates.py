"""Lone UTF-16 surrogates are found wherever they are; ASCII text is never scanned."""

from __future__ import annotations

import pytest

from qtts.request import request_limits as lim


@pytest.mark.parametrize(
    "text, expected",
    [
        ("plain ascii", False),
        ("", False),
        ("café 😀 中文", False),  # non-ASCII, valid Unicode
        ("a\ud800b", True),
        ("é\udfff", True),
        ("😀" * 1000 + "\udc00", True),
    ],
)
def test_has_surrogate(text, expected):
    assert lim.has_surrogate(text) is expected


def test_ascii_text_skips_the_scan(monkeypatch):
    class Never:
        def search(self, value):
            raise AssertionError("an ASCII string was scanned")

    monkeypatch.setattr(lim, "_SURROGATE", Never())
    assert lim.has_surrogate("A" * 200_000) is False
    with pytest.raises(AssertionError):
        lim.has_surrogate("é")  # non-ASCII text is still scanned
