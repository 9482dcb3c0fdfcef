"""ConsentStore with API keys: each key pages through its own records only, across the backend's
pages (which hold every key's records, interleaved)."""

from __future__ import annotations

import pytest

from qtts.request.errors import InvalidArgument, NotFound
from services.gateway.auth import owner_var
from services.gateway.consents import ConsentStore


async def _create_as(store: ConsentStore, owner: str, n: int) -> list[str]:
    token = owner_var.set(owner)
    try:
        return [(await store.create(f"{owner} {i}", "en", b"rec")).id for i in range(n)]
    finally:
        owner_var.reset(token)


async def test_paging_skips_other_keys_records_and_says_when_more_follow():
    store = ConsentStore()
    mine, theirs = [], []
    for _ in range(3):  # interleaved, over more than one backend page (100)
        mine += await _create_as(store, "aaaaaaaa", 60)
        theirs += await _create_as(store, "bbbbbbbb", 60)
    token = owner_var.set("aaaaaaaa")
    try:
        seen, after = [], None
        while True:
            records, more = await store.page(after, 70)
            seen += [c.id for c in records]
            if not more:
                break
            after = records[-1].id
        assert seen == mine
        last, more = await store.page(mine[-2], 70)
        assert [c.id for c in last] == [mine[-1]] and more is False
        with pytest.raises(InvalidArgument, match="after: no voice consent"):
            await store.page(theirs[0], 10)
        with pytest.raises(NotFound):
            await store.get(theirs[0])
        with pytest.raises(NotFound) as err:
            await store.check(theirs[0])
        assert err.value.param == "consent"
    finally:
        owner_var.reset(token)
    # Without keys every record is everyone's.
    assert len((await store.page(None, 100))[0]) == 100
