"""The talker's one /metrics when its engine runs in a process of its own (engine_process.py).

Both processes keep a `TalkerMetrics`; each updates the series it owns (the engine process: steps,
batches, admission, queue; the front: streams, hops, underruns, calls) and leaves the others at
zero. A scrape merges them: a sample both report (same name and labels) is summed, as
prometheus_client's multiprocess mode sums counters, histograms and "sum"-mode gauges; a
`_created` sample keeps the earlier time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from qtts.serving.metrics import TalkerMetrics


def engine_metrics() -> TalkerMetrics:
    """The engine process's metrics (its registry is sent to the front on every scrape)."""
    return TalkerMetrics(CollectorRegistry())


def merge_families(*groups: Iterable[Metric]) -> list[Metric]:
    merged: dict[str, Metric] = {}
    index: dict[str, dict[tuple, int]] = {}
    for families in groups:
        for family in families:
            have = merged.get(family.name)
            if have is None:
                have = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = have
                index[family.name] = {}
            at = index[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                i = at.get(key)
                if i is None:
                    at[key] = len(have.samples)
                    have.samples.append(sample)
                    continue
                old = have.samples[i]
                if sample.name.endswith("_created"):
                    value = min(old.value, sample.value)
                else:
                    value = old.value + sample.value
                have.samples[i] = old._replace(value=value)
    return list(merged.values())


class MergedRegistry:
    """A registry-like view (what `start_http_server` and tests read) of `own` plus the engine
    process's families from `remote()`."""

    def __init__(self, own: CollectorRegistry, remote: Callable[[], list[Metric]]):
        self.own = own
        self._remote = remote

    def collect(self) -> Iterator[Metric]:
        yield from merge_families(self.own.collect(), self._remote())

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> Any:
        labels = labels or {}
        for metric in self.collect():
            for s in metric.samples:
                if s.name == name and s.labels == labels:
                    return s.value
        return None
