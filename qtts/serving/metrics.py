"""Prometheus metrics of each service, held on a registry the service owns (no global registry).

Every service builds one metrics object at start-up and injects it where it is needed::

    from prometheus_client import CollectorRegistry
    from qtts.serving.metrics import Code2WavMetrics

    registry = CollectorRegistry()
    metrics = Code2WavMetrics(registry)
    metrics.live_states.inc()
    with metrics.stage_timer("decode"):
        ...
    metrics.error("INVALID_ARGUMENT")

`GrpcServiceHost` (qtts.serving.grpc_server) serves `registry` over HTTP and counts errors it maps through
`metrics.error(...)`. Names carry the `tts_` prefix and their unit (`_seconds`, `_frames`, `_total`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from qtts.serving.loop_lag import LoopLagMonitor
from qtts.serving.startup import StartupPhases

# Latencies of a streaming TTS stack span ~1 ms (a decode step) to tens of seconds (a long stream).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Waits of tens of ms that first audio is made of (LATENCY_BUCKETS step from 25 to 50 to 75 ms).
WAIT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.06,
    0.08,
    0.1,
    0.12,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
# Deadline slack (audio a listener has buffered when a chunk is handed on): no negative bounds, since
# prometheus_client drops `_sum` for them; a late chunk falls in the first bucket and counts as an underrun.
SLACK_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.2, 1.6, 2.0, 3.0, 5.0, 10.0)
# The streams the talker's admission allows at once (its capacity bound), observed once a step.
CAPACITY_BUCKETS = (32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 2048, 4096)
# The room a talker sends a gateway (requests it may send): none, a few, up to a burst's worth.
ROOM_BUCKETS = (0, 1, 4, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048)
# A call's whole life: a health check takes a millisecond, a stream up to the longest audio (330 s).
CALL_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServiceMetrics:
    """Metrics every service has: errors by gRPC code and per-stage latency.

    `service` is the label value used in the shared series (`gateway`, `talker`, `code2wav`,
    `speaker_cache`).
    """

    def __init__(self, registry: CollectorRegistry, service: str):
        self.registry = registry
        self.service = service
        # process_* (CPU, memory, open files) and python_* (GC, version) series, as on the default registry.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.rpc_total = Counter(
            "tts_rpc_requests_total",
            "gRPC calls this service handled, by method and final status code.",
            ["service", "method", "code"],
            registry=registry,
        )
        self.rpc_duration_seconds = Histogram(
            "tts_rpc_duration_seconds",
            "gRPC call time from arrival to the last message (a stream's whole life).",
            ["service", "method"],
            buckets=CALL_BUCKETS,
            registry=registry,
        )
        self.errors_total = Counter(
            "tts_errors_total",
            "Requests that ended with an error, by gRPC status code.",
            ["service", "code"],
            registry=registry,
        )
        self.stage_latency_seconds = Histogram(
            "tts_stage_latency_seconds",
            "Latency of a named processing stage.",
            ["service", "stage"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.rpc_accept_seconds = Histogram(
            "tts_rpc_accept_seconds",
            "How long a call waited from its caller sending it to this service's handler running "
            "(callers among the services say when they sent it; across hosts it carries their "
            "clock offset).",
            ["service", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.session_write_seconds = Histogram(
            "tts_session_write_seconds",
            "Session calls (many streams on one call): from the oldest item a message carries being "
            "queued to the message written, by session method. The chunk hops count handing on to "
            "a session as done; this is the rest of the way.",
            ["service", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # tts_event_loop_lag_seconds: sampled while the service's GrpcServiceHost runs.
        self.loop_lag = LoopLagMonitor(registry, service)
        self.startup = StartupPhases(registry, service)  # tts_startup_seconds

    def error(self, code: str) -> None:
        """Count one error by its gRPC status code name (e.g. "INVALID_ARGUMENT")."""
        self.errors_total.labels(self.service, code).inc()

    def rpc(self, method: str, code: str, seconds: float) -> None:
        """Count one finished gRPC call (`method` is the full /package.Service/Method path)."""
        self.rpc_total.labels(self.service, method, code).inc()
        self.rpc_duration_seconds.labels(self.service, method).observe(seconds)

    def rpc_accepted(self, method: str, seconds: float) -> None:
        """A call's handler runs `seconds` after its caller sent it."""
        self.rpc_accept_seconds.labels(self.service, method).observe(seconds)

    def session_written(self, method: str, seconds: float) -> None:
        """A message on a session call (`method`) was written `seconds` after its oldest item was queued."""
        self.session_write_seconds.labels(self.service, method).observe(seconds)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_latency_seconds.labels(self.service, stage).observe(seconds)

    @contextmanager
    def stage_timer(self, stage: str) -> Iterator[None]:
        """Time the enclosed block into `tts_stage_latency_seconds{stage=...}`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe_stage(stage, time.perf_counter() - start)


class GatewayMetrics(ServiceMetrics):
    """Gateway: requests by protocol and status, time to first audio, duration, active streams."""

    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry, "gateway")
        self.requests_total = Counter(
            "tts_gateway_requests_total",
            "Synthesis requests by protocol (http/grpc) and final status.",
            ["protocol", "status"],
            registry=registry,
        )
        self.ttfa_seconds = Histogram(
            "tts_gateway_ttfa_seconds",
            "Request received to first audio byte sent.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.refusal_hop_seconds = Histogram(
            "tts_gateway_refusal_hop_seconds",
            "Where a request refused after admission at the gateway (RESOURCE_EXHAUSTED from the "
            "talker, or later at the gateway) spent its time, per hop: admit (from the gateway "
            "letting it in to its talker call: the reference clip), talker (the call to its "
            "refusal). The time before (the body, its checks) is in the access log's duration.",
            ["hop"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.room_wait_seconds = Histogram(
            "tts_gateway_room_wait_seconds",
            "How long a request that found this gateway's share of the talkers' room spent waited "
            "for the next published room (--talker-room-wait-ms), by outcome: room (it got a "
            "talker) or refused (none came in time).",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_chunk_hop_seconds = Histogram(
            "tts_gateway_first_chunk_hop_seconds",
            "Where a request's first audio goes at the gateway, per hop: admit (request received "
            "to the talker call: admission, reference clip), talker (the call to its first audio "
            "chunk: the talker's and code2wav's hops, tts_talker_first_chunk_hop_seconds, and the "
            "network), to_client (that chunk to its first byte out: encoding; for a whole-clip "
            "response, the rest of the clip). Their sum is tts_gateway_ttfa_seconds.",
            ["hop"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.request_duration_seconds = Histogram(
            "tts_gateway_request_duration_seconds",
            "Request received to last audio byte sent.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.active_streams = Gauge(
            "tts_gateway_active_streams",
            "Synthesis streams in progress.",
            registry=registry,
        )
        self.deadline_slack_seconds = Histogram(
            "tts_gateway_deadline_slack_seconds",
            "Audio the listener had buffered when the gateway handed a chunk to its connection "
            "(playback starts at the first chunk); below 0 the listener heard a gap.",
            buckets=SLACK_BUCKETS,
            registry=registry,
        )
        self.underruns_total = Counter(
            "tts_gateway_underruns_total",
            "Chunks handed to the client's connection after their playback deadline.",
            registry=registry,
        )
        self.reference_cache_hits = Counter(
            "tts_gateway_reference_cache_hits_total",
            "Reference clips served from the decoded-clip cache (no decode).",
            registry=registry,
        )
        self.reference_cache_misses = Counter(
            "tts_gateway_reference_cache_misses_total",
            "Reference clips decoded (not in the decoded-clip cache).",
            registry=registry,
        )
        self.http_requests_total = Counter(
            "tts_http_requests_total",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.http_request_duration_seconds = Histogram(
            "tts_http_request_duration_seconds",
            "HTTP request time to the last body byte (a streamed response's whole life), by route.",
            ["route", "method"],
            buckets=CALL_BUCKETS,
            registry=registry,
        )

    def http_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.http_requests_total.labels(route, method, str(status)).inc()
        self.http_request_duration_seconds.labels(route, method).observe(seconds)


class TalkerMetrics(ServiceMetrics):
    """Talker: active streams, queue, step/prefill time, batch size, frames, credit stalls."""

    def __init__(self, registry: CollectorRegistry):
        """Long, kept in one piece: a flat table of metric declarations, one per metric."""
        super().__init__(registry, "talker")
        self.active_streams = Gauge(
            "tts_talker_active_streams",
            "Streams admitted to the generator.",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "tts_talker_queue_depth",
            "Requests waiting for a generator slot.",
            registry=registry,
        )
        self.step_seconds = Histogram(
            "tts_talker_step_seconds",
            "Time of one batched frame step.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "tts_talker_prefill_seconds",
            "Time of a prefill.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_wait_seconds = Histogram(
            "tts_talker_prefill_wait_seconds",
            "From a request's admission to the start of the step that holds its prefill: the wait "
            "for other prompts to share it (--prefill-coalesce-ms) and for the step running then.",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "tts_talker_batch_size",
            "Streams stepped together in one frame step.",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.frames_total = Counter(
            "tts_talker_frames_total",
            "Codec frames generated.",
            registry=registry,
        )
        self.credit_stalls_total = Counter(
            "tts_talker_credit_stalls_total",
            "Times a stream could not send a frame for lack of credit.",
            registry=registry,
        )
        self.admission_held = Gauge(
            "tts_talker_admission_held",
            "1 while the real-time guard holds waiting requests back (running streams at their pace limit).",
            registry=registry,
        )
        self.admission_holds_total = Counter(
            "tts_talker_admission_holds_total",
            "Times the real-time guard started holding waiting requests back.",
            registry=registry,
        )
        self.paused_streams = Gauge(
            "tts_talker_paused_streams",
            "Running streams paused because they are far enough ahead of their listener.",
            registry=registry,
        )
        self.text_waiting_streams = Gauge(
            "tts_talker_text_waiting_streams",
            "Running streams whose text is still arriving and has no token for their next frame "
            "(skipped, their playback clock paused).",
            registry=registry,
        )
        self.deadline_slack_seconds = Histogram(
            "tts_talker_deadline_slack_seconds",
            "Audio the listener had buffered when a chunk was handed on (its playback clock starts "
            "at the first chunk); below 0 the listener heard a gap.",
            buckets=SLACK_BUCKETS,
            registry=registry,
        )
        self.underruns_total = Counter(
            "tts_talker_underruns_total",
            "Chunks handed on after their playback deadline (server-detected gaps).",
            registry=registry,
        )
        self.refused_total = Counter(
            "tts_talker_refused_total",
            "Requests refused by admission (queue full or first-audio budget spent).",
            registry=registry,
        )
        self.room_refused_total = Counter(
            "tts_talker_room_refused_total",
            "Of the requests refused by admission, those the talker's front refused at once from "
            "its engine process's last room (no voice prompt fetched, no prompt build sent).",
            registry=registry,
        )
        self.chunk_hop_seconds = Histogram(
            "tts_talker_chunk_hop_seconds",
            "Where a chunk's time goes, per hop: generate (from the previous chunk's hand-on to the "
            "chunk's last frame), engine_to_loop (engine thread to the stream's task), to_code2wav "
            "(waiting for credit or the chunk boundary), code2wav (frames sent to audio back), "
            "to_gateway (audio yielded until the caller took it: a Generate call's write, or the hand-off to a Session call's writer).",
            ["hop"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.code2wav_transit_seconds = Histogram(
            "tts_talker_code2wav_transit_seconds",
            "Of a chunk's code2wav hop (frames sent to audio back, tts_talker_chunk_hop_seconds), the "
            "part code2wav did not hold it (its wait for a decode call and the call, which it reports "
            "with the audio): the frames' trip there, the audio's trip back, both event loops.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.code2wav_audio_queued_seconds = Histogram(
            "tts_talker_code2wav_audio_queued_seconds",
            "Of a chunk's code2wav hop, the audio's wait on the talker: from its message read off "
            "the code2wav call to the stream's task taking it (the talker's event loop and queues; "
            "the rest of tts_talker_code2wav_transit_seconds is the wire and code2wav's side).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_chunk_hop_seconds = Histogram(
            "tts_talker_first_chunk_hop_seconds",
            "Where a stream's first chunk's time goes, per hop (as tts_talker_chunk_hop_seconds, with "
            "generate counted from the request's submission to the engine: queue, prefill, frames).",
            ["hop"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefix_cache_lookups_total = Counter(
            "tts_talker_prefix_cache_lookups_total",
            "Prompt-prefix KV cache lookups of admitted prompts, by result (hit: the voice's prefix "
            "was copied from the GPU cache instead of prefilled).",
            ["result"],
            registry=registry,
        )
        self.predicted_step_seconds = Gauge(
            "tts_talker_predicted_step_seconds",
            "Frame step time the admission model predicts for every running stream stepping at once.",
            registry=registry,
        )
        self.admission_capacity_streams = Histogram(
            "tts_talker_admission_capacity_streams",
            "The streams admission allows at once (its duty and load bounds over the fitted costs), "
            "observed once a step: its spread is how much the estimate moves under load.",
            buckets=CAPACITY_BUCKETS,
            registry=registry,
        )
        self.published_room_streams = Histogram(
            "tts_talker_published_room_streams",
            "The room each GetCapacity answer or WatchCapacity message sent a gateway carried (the "
            "requests that gateway may send now: its share of what the talker would accept), "
            "observed per message: a closed loop's opening burst shows in the low buckets.",
            buckets=ROOM_BUCKETS,
            registry=registry,
        )
        self.room_seconds = Histogram(
            "tts_talker_room_seconds",
            "How long a room for a gateway took to work out (the engine's headroom; with the "
            "engine in its own process, a round trip to it), one observation a message sent.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.room_calls_seen_meanwhile = Histogram(
            "tts_talker_room_calls_seen_meanwhile",
            "The gateway's calls the talker saw while a room for that gateway was worked out: the "
            "room may count them queued while the gateway still counts them unseen, so each is "
            "room the gateway loses until its next message.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.start_plans_total = Counter(
            "tts_talker_start_plans_total",
            "New streams by the first chunk asked of code2wav (first: frames, or default: the "
            "replica's own plan) and why: counts (how busy the talker was), timing (moved up: the "
            "recent steps and trips would make a smaller start late), backlog (moved up: the request "
            "arrived behind a queue and starts under whatever load is then) or request (the "
            "caller's plan).",
            ["first", "why"],
            registry=registry,
        )
        self.start_plan_misfits_total = Counter(
            "tts_talker_start_plan_misfits_total",
            "Smaller starts the talker checked for a new stream and turned down, by the start's "
            "first chunk (frames) and the bound it failed: ramp (the recent steps too slow for its "
            "ramp) or trip (its first chunk's audio does not cover the next chunk's steps and trip "
            "through code2wav).",
            ["first", "bound"],
            registry=registry,
        )
        self.steps_over_capacity_total = Counter(
            "tts_talker_steps_over_capacity_total",
            "Steps with more streams running than the admission capacity of that moment (admitted "
            "under a higher estimate): new requests wait for streams to end, or are refused.",
            registry=registry,
        )
        self.admission_cost_seconds = Gauge(
            "tts_talker_admission_cost_seconds",
            "The costs admission works with, as fitted or published: step_base and step_per_stream "
            "(the frame step), prefill_request (one prompt's prefill), decoder_frame (code2wav's "
            "decode of one frame on this GPU, as the capacity counts it: published or the prior).",
            ["cost"],
            registry=registry,
        )


class Code2WavMetrics(ServiceMetrics):
    """code2wav: live decoder states, backlog, decode time, frames decoded, rejected streams."""

    def __init__(self, registry: CollectorRegistry):
        """Long, kept in one piece: a flat table of metric declarations, one per metric."""
        super().__init__(registry, "code2wav")
        self.live_states = Gauge(
            "tts_code2wav_live_states",
            "Decoder states held (one per open stream).",
            registry=registry,
        )
        self.decode_backlog_frames = Gauge(
            "tts_code2wav_decode_backlog_frames",
            "Frames received and not yet decoded, all streams.",
            registry=registry,
        )
        self.decode_seconds = Histogram(
            "tts_code2wav_decode_seconds",
            "Time of one batched decode step.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.decode_batch_streams = Histogram(
            "tts_code2wav_decode_batch_streams",
            "Streams in one batched decode call.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=registry,
        )
        self.decode_batch_frames = Histogram(
            "tts_code2wav_decode_batch_frames",
            "Frames in one batched decode call, all its streams' chunks together.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=registry,
        )
        # What a talker on this GPU counts (published on every credit grant): where an open
        # loop's calls of a few streams each give a per-frame cost far above the engine's own.
        self.decode_cost_seconds = Gauge(
            "tts_code2wav_decode_cost_seconds",
            "The decode cost this replica last fitted and publishes: call (a call's fixed part) "
            "and frame (each frame's).",
            ["cost"],
            registry=registry,
        )
        self.decode_model_steps = Histogram(
            "tts_code2wav_decode_model_steps",
            "Decoder runs (graph replays or eager steps) one batched decode call took: one per "
            "(rows, frames) shape the batch planner split it into.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=registry,
        )
        self.frames_total = Counter(
            "tts_code2wav_frames_total",
            "Codec frames decoded.",
            registry=registry,
        )
        self.prefix_state_hits_total = Counter(
            "tts_code2wav_prefix_state_hits_total",
            "Streams whose decoder state after the ICL reference prefix was copied from the cache.",
            registry=registry,
        )
        self.prefix_state_misses_total = Counter(
            "tts_code2wav_prefix_state_misses_total",
            "Streams whose ICL reference prefix was decoded (not in the prefix-state cache).",
            registry=registry,
        )
        self.rejected_total = Counter(
            "tts_code2wav_rejected_total",
            "Streams rejected because the state bound was reached.",
            registry=registry,
        )
        self.chunk_wait_seconds = Histogram(
            "tts_code2wav_chunk_wait_seconds",
            "Time a chunk waited for a decode call once all its frames were there.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_chunk_wait_seconds = Histogram(
            "tts_code2wav_first_chunk_wait_seconds",
            "Time a stream's first chunk waited for a decode call once all its frames were there.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_chunk_state_wait_seconds = Histogram(
            "tts_code2wav_first_chunk_state_wait_seconds",
            "Of a stream's first chunk's wait (tts_code2wav_first_chunk_wait_seconds), the part "
            "before the stream's decoder state was made (its reference prefix decoded, the start "
            "queued behind decode calls).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.session_message_wait_seconds = Histogram(
            "tts_code2wav_session_message_wait_seconds",
            "DecodeSession: a stream's message (frames, ack, end) from its read off the call to the "
            "stream taking it (code2wav's event loop and queue; a new stream's first messages also "
            "wait for its start). Of the talker's code2wav hop in transit, this side's share on the "
            "way in.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.deadline_slack_seconds = Histogram(
            "tts_code2wav_deadline_slack_seconds",
            "Audio already sent ahead of the stream's playback clock when a decoded chunk is "
            "handed on; below 0 the chunk is late (the listener ran dry).",
            buckets=SLACK_BUCKETS,
            registry=registry,
        )
        self.underruns_total = Counter(
            "tts_code2wav_underruns_total",
            "Decoded chunks handed on after their playback deadline.",
            registry=registry,
        )


class SpeakerCacheMetrics(ServiceMetrics):
    """speaker_cache: voice-prompt hits and misses, named voices stored."""

    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry, "speaker_cache")
        self.hits_total = Counter(
            "tts_speaker_cache_hits_total",
            "Voice-prompt lookups that found a prompt.",
            registry=registry,
        )
        self.misses_total = Counter(
            "tts_speaker_cache_misses_total",
            "Voice-prompt lookups that found nothing.",
            registry=registry,
        )
        self.voices = Gauge(
            "tts_speaker_cache_voices",
            "Named voices stored.",
            registry=registry,
        )


class AlignerMetrics(ServiceMetrics):
    """aligner: forward passes, their batch sizes and the audio they aligned."""

    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry, "aligner")
        self.batch_size = Histogram(
            "tts_aligner_batch_size",
            "Requests that shared one forward pass.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.forward_seconds = Histogram(
            "tts_aligner_forward_seconds",
            "Time of one batched forward pass on the device.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.audio_seconds_total = Counter(
            "tts_aligner_audio_seconds_total",
            "Seconds of audio aligned.",
            registry=registry,
        )
        self.queued = Gauge(
            "tts_aligner_queued_requests",
            "Requests prepared and waiting for a forward pass.",
            registry=registry,
        )
        self.rest_seconds_total = Counter(
            "tts_aligner_rest_seconds_total",
            "Time forward passes were held back to keep within --gpu-share of the device.",
            registry=registry,
        )
