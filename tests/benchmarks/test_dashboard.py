"""The Grafana dashboard parses and queries only the metric names the services export."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tts-dashboard.json"

# The names `qtts/serving/metrics.py` exports (DESIGN.md and the metrics contract).
COUNTERS_AND_GAUGES = {
    "tts_gateway_requests_total",
    "tts_gateway_active_streams",
    "tts_talker_active_streams",
    "tts_talker_queue_depth",
    "tts_talker_frames_total",
    "tts_talker_credit_stalls_total",
    "tts_talker_admission_held",
    "tts_talker_admission_holds_total",
    "tts_gateway_reference_cache_hits_total",
    "tts_gateway_reference_cache_misses_total",
    "tts_code2wav_prefix_state_hits_total",
    "tts_code2wav_prefix_state_misses_total",
    "tts_code2wav_live_states",
    "tts_code2wav_decode_backlog_frames",
    "tts_code2wav_frames_total",
    "tts_code2wav_rejected_total",
    "tts_speaker_cache_hits_total",
    "tts_speaker_cache_misses_total",
    "tts_speaker_cache_voices",
    "tts_errors_total",
    "tts_talker_paused_streams",
    "tts_talker_text_waiting_streams",
    "tts_talker_underruns_total",
    "tts_talker_refused_total",
    "tts_talker_room_refused_total",
    "tts_talker_predicted_step_seconds",
    "tts_talker_prefix_cache_lookups_total",
    "tts_code2wav_underruns_total",
    "tts_rpc_requests_total",
    "tts_http_requests_total",
    "tts_gateway_underruns_total",
    "tts_event_loop_lag_max_seconds",
    "tts_startup_seconds",
    "tts_talker_steps_over_capacity_total",
    "tts_talker_start_plans_total",
    "tts_talker_start_plan_misfits_total",
    "tts_talker_admission_cost_seconds",
    "tts_code2wav_decode_cost_seconds",
    "tts_aligner_audio_seconds_total",
    "tts_aligner_queued_requests",
    "tts_aligner_rest_seconds_total",
}
HISTOGRAMS = {
    "tts_gateway_ttfa_seconds",
    "tts_gateway_request_duration_seconds",
    "tts_talker_step_seconds",
    "tts_talker_prefill_seconds",
    "tts_talker_prefill_wait_seconds",
    "tts_talker_batch_size",
    "tts_code2wav_decode_seconds",
    "tts_code2wav_decode_batch_streams",
    "tts_code2wav_decode_batch_frames",
    "tts_code2wav_decode_model_steps",
    "tts_stage_latency_seconds",
    "tts_talker_deadline_slack_seconds",
    "tts_code2wav_deadline_slack_seconds",
    "tts_talker_chunk_hop_seconds",
    "tts_talker_first_chunk_hop_seconds",
    "tts_gateway_first_chunk_hop_seconds",
    "tts_gateway_refusal_hop_seconds",
    "tts_gateway_room_wait_seconds",
    "tts_event_loop_lag_seconds",
    "tts_rpc_accept_seconds",
    "tts_session_write_seconds",
    "tts_code2wav_first_chunk_wait_seconds",
    "tts_code2wav_first_chunk_state_wait_seconds",
    "tts_code2wav_chunk_wait_seconds",
    "tts_rpc_duration_seconds",
    "tts_http_request_duration_seconds",
    "tts_gateway_deadline_slack_seconds",
    "tts_talker_admission_capacity_streams",
    "tts_talker_published_room_streams",
    "tts_talker_room_seconds",
    "tts_talker_room_calls_seen_meanwhile",
    "tts_talker_code2wav_transit_seconds",
    "tts_talker_code2wav_audio_queued_seconds",
    "tts_code2wav_session_message_wait_seconds",
    "tts_aligner_batch_size",
    "tts_aligner_forward_seconds",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC = re.compile(r"\b(tts_[a-z0-9_]+)")


def _panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return panels


def _queried_series() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        name for p in _panels(dashboard) for t in p.get("targets", []) for name in METRIC.findall(t["expr"])
    ]


def _base_name(series: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix) and series[: -len(suffix)] in HISTOGRAMS:
            return series[: -len(suffix)]
    return series


def test_dashboard_parses_and_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"]
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        assert all(t["expr"].count("(") == t["expr"].count(")") for t in panel["targets"])


def test_dashboard_queries_only_exported_metrics():
    series = _queried_series()
    assert series
    allowed = COUNTERS_AND_GAUGES | HISTOGRAMS
    unknown = {s for s in series if _base_name(s) not in allowed}
    assert not unknown, f"dashboard queries metrics nobody exports: {sorted(unknown)}"
    # A histogram is only queryable through its _bucket/_sum/_count series.
    bare_histograms = {s for s in series if s in HISTOGRAMS}
    assert not bare_histograms


def test_dashboard_shows_every_exported_metric():
    used = {_base_name(s) for s in _queried_series()}
    assert (COUNTERS_AND_GAUGES | HISTOGRAMS) - used == set()


def test_the_lists_above_are_what_the_services_export():
    from prometheus_client import CollectorRegistry

    from qtts.serving import metrics

    exported: dict[str, str] = {}
    for cls in (
        metrics.GatewayMetrics,
        metrics.TalkerMetrics,
        metrics.Code2WavMetrics,
        metrics.SpeakerCacheMetrics,
        metrics.AlignerMetrics,
    ):
        registry = CollectorRegistry()
        cls(registry)
        for family in registry.collect():
            if not family.name.startswith("tts_"):
                continue  # process_* / python_*: the client library's own
            name = family.name + "_total" if family.type == "counter" else family.name
            exported[name] = family.type
    assert {n for n, t in exported.items() if t == "histogram"} == HISTOGRAMS
    assert {n for n, t in exported.items() if t != "histogram"} == COUNTERS_AND_GAUGES
