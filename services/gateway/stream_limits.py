"""Stream limits: a bound on concurrent synthesis streams, in all and per client, rejecting
(not queueing) beyond it."""

from __future__ import annotations

from collections import Counter

from qtts.request.errors import ResourceExhausted

# What a refused client is told to wait (Retry-After): streams last seconds, so one is enough to
# find a free slot or to be refused again cheaply.
RETRY_AFTER_S = 1


class StreamLimits:
    """Counts admitted streams; `admit()` fails at once when `max_streams` are in progress, or
    when `client` already holds `max_per_client` of them (0: no per-client bound).

    Rejecting immediately (429 / RESOURCE_EXHAUSTED) rather than queueing keeps the latency of every
    admitted stream bounded and lets a load balancer retry elsewhere; the per-client bound keeps
    one client (an API key, else an address) from taking every slot.
    """

    def __init__(self, max_streams: int, max_per_client: int = 0):
        if max_streams < 1:
            raise ValueError("max_streams must be >= 1")
        if max_per_client < 0:
            raise ValueError("max_per_client must be >= 0")
        self.max_streams = max_streams
        self.max_per_client = max_per_client
        self._active = 0
        # Slots kept for requests let in on their headers whose bodies are still being read.
        self._held = 0
        self._by_client: Counter[str] = Counter()

    @property
    def active(self) -> int:
        return self._active

    def active_for(self, client: str) -> int:
        return self._by_client[client]

    @property
    def held(self) -> int:
        return self._held

    def refusal(self, client: str = "") -> ResourceExhausted | None:
        """What `admit(client)` would raise now, or None when it would admit: a peek, no slot taken.
        Held slots count as taken."""
        if self._active + self._held >= self.max_streams:
            return ResourceExhausted(
                f"server is at its limit of {self.max_streams} concurrent streams; retry later",
                retry_after_s=RETRY_AFTER_S,
            )
        if self.max_per_client and client and self._by_client.get(client, 0) >= self.max_per_client:
            return ResourceExhausted(
                f"this client already has {self.max_per_client} concurrent streams, its limit; retry "
                "when one has ended",
                retry_after_s=RETRY_AFTER_S,
            )
        return None

    def hold(self) -> None:
        """Keep a slot for a request let in on its headers until `admit(held=True)` or `unhold()`:
        a burst past the limit is then refused on its headers, not after each body is read."""
        self._held += 1

    def unhold(self) -> None:
        if self._held <= 0:
            raise RuntimeError("unhold() without hold()")
        self._held -= 1

    def admit(self, client: str = "", held: bool = False) -> None:
        """Take a slot (`held`: the one `hold()` kept, whether or not this admits)."""
        if held:
            self.unhold()
        refused = self.refusal(client)
        if refused is not None:
            raise refused
        self._active += 1
        if client:
            self._by_client[client] += 1

    def release(self, client: str = "") -> None:
        if self._active <= 0:
            raise RuntimeError("release() without admit()")
        self._active -= 1
        if client:
            self._by_client[client] -= 1
            if self._by_client[client] <= 0:
                del self._by_client[client]
