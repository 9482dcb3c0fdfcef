"""The bounded set of live decode streams, keyed by this server's own stream ids."""

from __future__ import annotations

from collections.abc import Iterator

from qtts.request.errors import ResourceExhausted
from qtts.serving.metrics import Code2WavMetrics
from services.code2wav.stream import DecodeStream


class StreamRegistry:
    """At most `max_states` streams hold a decoder state; one more is rejected, never queued."""

    def __init__(self, max_states: int, metrics: Code2WavMetrics):
        if max_states < 1:
            raise ValueError("max_states must be >= 1")
        self.max_states = max_states
        self.metrics = metrics
        self._streams: dict[str, DecodeStream] = {}

    def add(self, stream: DecodeStream) -> None:
        if len(self._streams) >= self.max_states:
            self.metrics.rejected_total.inc()
            raise ResourceExhausted(f"decoder state limit reached ({self.max_states} live streams)")
        self._streams[stream.stream_id] = stream
        self.metrics.live_states.set(len(self._streams))

    def remove(self, stream_id: str) -> DecodeStream | None:
        stream = self._streams.pop(stream_id, None)
        self.metrics.live_states.set(len(self._streams))
        return stream

    def get(self, stream_id: str) -> DecodeStream | None:
        return self._streams.get(stream_id)

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[DecodeStream]:
        return iter(list(self._streams.values()))
