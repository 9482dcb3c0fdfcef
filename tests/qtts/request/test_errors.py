"""The retry hint of a refusal: whole seconds as the standard asks, and milliseconds spread at
random over half a hint more, so that clients that honour it come back apart."""

from __future__ import annotations

from qtts.request.errors import retry_after_ms, retry_headers


def test_the_spread_hint_is_never_before_the_hint_nor_past_half_as_much_again():
    assert retry_after_ms(2, draw=lambda: 0.0) == 2000
    assert retry_after_ms(2, draw=lambda: 0.999) == 2999
    drawn = {retry_after_ms(1) for _ in range(200)}
    assert all(1000 <= ms < 1500 for ms in drawn) and len(drawn) > 50  # spread, not one instant


def test_the_http_headers_carry_both_forms():
    headers = retry_headers(3)
    assert headers["Retry-After"] == "3" and 3000 <= int(headers["retry-after-ms"]) < 4500
