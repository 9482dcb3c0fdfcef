"""`GET /v1/status`: the served model and a few load figures as JSON, for the playground's status strip.

The gateway's own figures come from its metrics registry; the talker's (queue, step time) from its
`/metrics` page when the gateway is told where that is (`--talker-metrics-url`). Histograms are
given as running sum and count, so a poller takes the difference of two polls for a recent mean.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from prometheus_client import Metric
from prometheus_client.parser import text_string_to_metric_families

from .core import GatewayCore

# Talker samples the strip shows, by the key they get in the JSON.
_TALKER_SAMPLES = {
    "active_streams": "tts_talker_active_streams",
    "queue_depth": "tts_talker_queue_depth",
    "step_seconds_sum": "tts_talker_step_seconds_sum",
    "step_seconds_count": "tts_talker_step_seconds_count",
}


def _sample_sums(families: Iterable[Metric], names: Iterable[str]) -> dict[str, float]:
    """Each named sample summed over its labels (absent names are left out)."""
    wanted, out = set(names), {}
    for family in families:
        for s in family.samples:
            if s.name in wanted:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class StatusReporter:
    """Builds the status JSON: model, gateway load and (when reachable) talker load."""

    def __init__(self, synth: GatewayCore, talker_metrics_url: str = "", timeout_s: float = 1.0):
        self._synth = synth
        self._talker_metrics_url = talker_metrics_url
        self._timeout_s = timeout_s

    async def snapshot(self) -> dict:
        synth = self._synth
        families = list(synth.metrics.registry.collect())
        g = _sample_sums(
            families,
            (
                "tts_gateway_active_streams",
                "tts_gateway_requests_total",
                "tts_gateway_ttfa_seconds_sum",
                "tts_gateway_ttfa_seconds_count",
            ),
        )
        model = None
        if synth.ready:
            c = synth.catalog()
            model = {
                "id": c.name,
                "model_type": c.model_type,
                "model_size": c.model_size,
                "languages": list(c.languages),
                "sample_rate": c.sample_rate,
            }
        return {
            "object": "status",
            "ready": synth.ready,
            "model": model,
            "gateway": {
                "active_streams": int(g.get("tts_gateway_active_streams", 0)),
                "max_streams": synth.admission.max_streams,
                "requests_total": int(g.get("tts_gateway_requests_total", 0)),
                "ttfa_seconds_sum": g.get("tts_gateway_ttfa_seconds_sum", 0.0),
                "ttfa_seconds_count": int(g.get("tts_gateway_ttfa_seconds_count", 0)),
            },
            "talker": await self._talker(),
        }

    async def _talker(self) -> dict | None:
        """The talker's figures; None when not configured, `{"error": ...}` when unreachable (the
        message names no internal address)."""
        if not self._talker_metrics_url:
            return None
        try:
            async with httpx.AsyncClient(timeout=self._timeout_s) as client:
                resp = await client.get(self._talker_metrics_url)
                resp.raise_for_status()
        except httpx.HTTPError:
            return {"error": "talker metrics unreachable"}
        found = _sample_sums(text_string_to_metric_families(resp.text), _TALKER_SAMPLES.values())
        out: dict = {key: found.get(name, 0.0) for key, name in _TALKER_SAMPLES.items()}
        for key in ("active_streams", "queue_depth", "step_seconds_count"):
            out[key] = int(out[key])
        return out
