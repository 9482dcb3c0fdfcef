"""Which long-lived session call new streams go on: the gateway's Session per talker and the
talker's DecodeSession per code2wav replica share it.

A session call is used only once it has answered (its server sends an empty message at once), so
a stream never goes on a call whose server turns out not to have the method, or is unreachable:
until then the caller makes a call of its own for the stream. A call takes new streams for
`rotate_s`; then the next one is opened, and the old one takes new streams until the new one has
answered, then is half-closed (it ends with its last stream). So a call lives about as long as
the streams put on it in `rotate_s`, and a drain or connection ageing cuts no more than it would
cut calls of their own. A server that answers UNIMPLEMENTED is not asked again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class SessionCall(Protocol):
    started: float
    answered: bool  # its first message came
    ended: bool
    unimplemented: bool  # it ended UNIMPLEMENTED before answering

    def half_close(self) -> None: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=SessionCall)


class SessionCalls(Generic[C]):
    """The call in use (answered) and the one opening; `current()` for a new stream."""

    def __init__(
        self, open_call: Callable[[float], C], rotate_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self._open = open_call
        self._rotate_s = rotate_s
        self._clock = clock
        self._in_use: C | None = None
        self._opening: C | None = None
        self._unimplemented = False

    @property
    def unimplemented(self) -> bool:
        """The server has no such method (its answer to the first call): it is not asked again."""
        self._settle()
        return self._unimplemented

    def _settle(self) -> None:
        """Put an answered opening call in use (half-closing the old one); drop ended calls."""
        opening = self._opening
        if opening is not None:
            if opening.answered and not opening.ended:
                if self._in_use is not None:
                    self._in_use.half_close()
                self._in_use, self._opening = opening, None
            elif opening.ended:
                self._opening = None
                self._unimplemented = self._unimplemented or opening.unimplemented
        if self._in_use is not None and self._in_use.ended:
            self._in_use = None

    def current(self) -> C | None:
        """The call a new stream goes on now, or None (the caller makes a call of its own; a
        session call is opened meanwhile, unless the server has none)."""
        self._settle()
        if self._unimplemented:
            return None
        now = self._clock()
        if self._opening is None and (self._in_use is None or now - self._in_use.started >= self._rotate_s):
            self._opening = self._open(now)
        return self._in_use

    @property
    def idle(self) -> bool:
        """No call is in use or opening."""
        return (self._in_use is None or self._in_use.ended) and (self._opening is None or self._opening.ended)

    async def close(self) -> None:
        for call in (self._in_use, self._opening):
            if call is not None:
                await call.close()
        self._in_use = self._opening = None
