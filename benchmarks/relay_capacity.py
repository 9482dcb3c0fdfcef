"""How many streams the gateway (and the benchmark client) carry without a GPU behind them.

A stand-in talker (`serve`) answers `talker.v1.TalkerService` with audio paced like the real
talker's under the deadline scheduler: the first chunk after `--first-audio-ms`, then the chunks of
the default chunk plan generated `--speedup` times faster than real time
until the stream is `--lead-s` ahead of its listener, then in real time. Its audio is a constant
tone (so the client's first-audible time equals its first-audio time). Everything behind the
gateway is then free, and any gap the client or the gateway's own playback clock
(`tts_gateway_underruns_total`) sees is made by the gateway or the client: the question the H200
sweep at 430f96f left open (no underrun in the talker or code2wav at c=512/768, gaps at the
client).

    python -m benchmarks.relay_capacity serve --port 50052
    python -m benchmarks.relay_capacity run --out run/relay --gateways 1 --processes 4 \
        -- --concurrency 256 512 768 --rounds 2
        # speaker_cache, this talker and the gateways as processes, then tts-bench through them;
        # the flags after -- go to tts-bench; every gateway's metrics are saved beside its results
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.streams.chunk_plan import ChunkPlan

if TYPE_CHECKING:
    from services.launcher import ServiceProcess, ServiceSpec, StackConfig

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE


def chunk_times(
    frames: int, plan: ChunkPlan, *, first_audio_s: float, speedup: float, lead_s: float
) -> list[tuple[float, int, int]]:
    """(seconds after the request, first frame, frames) of every chunk of a `frames`-long stream.

    Chunk k is ready once its last frame is generated: frames are made `speedup` times faster than
    real time, but never more than `lead_s` of audio ahead of a listener who starts playing when the
    first chunk arrives."""
    out: list[tuple[float, int, int]] = []
    sizes = plan.split(frames)
    if sizes and max(sizes) * FRAME_S > lead_s:
        # A chunk can only be on time if the stream may run at least that far ahead of playback.
        raise ValueError(f"lead {lead_s:g} s is shorter than a {max(sizes)}-frame chunk")
    step_s = FRAME_S / speedup
    start = 0
    t_first = None
    for size in sizes:
        end = start + size
        if t_first is None:
            t = first_audio_s
            t_first = t
        else:
            made = t_first + (end - sizes[0]) * step_s  # generated at full speed after the first chunk
            paced = t_first + end * FRAME_S - lead_s  # held back to `lead_s` ahead of playback
            t = max(made, paced)
        out.append((t, start, size))
        start = end
    return out


class PacedTalker(talker_pb2_grpc.TalkerServiceServicer):
    """Streams tone audio on the schedule of `chunk_times`; describes a Base model."""

    def __init__(self, *, frames: int, first_audio_s: float, speedup: float, lead_s: float):
        self.frames = frames
        self.first_audio_s = first_audio_s
        self.speedup = speedup
        self.lead_s = lead_s
        self.plan = ChunkPlan()
        tone = 0.25 * np.sin(2 * np.pi * 220 * np.arange(16 * SAMPLES_PER_FRAME) / SAMPLE_RATE)
        self._pcm = (tone * 32767).astype("<i2").tobytes()  # 16 frames, sliced per chunk

    async def GetModelInfo(self, request, context):  # noqa: N802 - gRPC method name
        return talker_pb2.GetModelInfoResponse(
            name="qwen3-tts-12hz-1.7b-base",
            model_type="base",
            model_size="1.7b",
            languages=["auto", "english", "chinese"],
            sample_rate_hz=SAMPLE_RATE,
            samples_per_frame=SAMPLES_PER_FRAME,
            num_codebooks=16,
        )

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: talker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[talker_pb2.GenerateResponse]:
        frames = request.max_new_frames or self.frames
        started = time.perf_counter()
        seq = 0
        for at, first, n in chunk_times(
            frames, self.plan, first_audio_s=self.first_audio_s, speedup=self.speedup, lead_s=self.lead_s
        ):
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            pcm = self._pcm[: n * SAMPLES_PER_FRAME * 2]
            yield talker_pb2.GenerateResponse(
                request_id=request.request_id,
                sequence_number=seq,
                audio=tts_pb2.AudioChunk(
                    audio=pcm,
                    num_samples=n * SAMPLES_PER_FRAME,
                    sample_rate_hz=SAMPLE_RATE,
                    first_frame_index=first,
                    num_frames=n,
                ),
            )
            seq += 1
        yield talker_pb2.GenerateResponse(
            request_id=request.request_id,
            sequence_number=seq,
            summary=talker_pb2.GenerateSummary(
                finish_reason=tts_pb2.FINISH_REASON_LENGTH,
                num_frames=frames,
                num_samples=frames * SAMPLES_PER_FRAME,
                code2wav_replica="paced-talker",
            ),
        )


async def serve(args: argparse.Namespace) -> None:
    host = GrpcServiceHost(
        service_names=[service_full_name(talker_pb2, "TalkerService")],
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        drain_seconds=1.0,
    )
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(
        PacedTalker(
            frames=args.frames,
            first_audio_s=args.first_audio_ms / 1e3,
            speedup=args.speedup,
            lead_s=args.lead_s,
        ),
        host.server,
    )
    await host.start()
    await host.set_serving()
    await host.serve_until_signal()


def run_stack(args: argparse.Namespace, client_args: Sequence[str]) -> int:
    """Start speaker_cache, the paced talker and `--gateways` gateways, run tts-bench through them
    (request i to gateway i mod N), save every gateway's metrics, and stop everything."""
    from services.launcher import (
        StackConfig,
        gateway_spec,
        speaker_cache_spec,
        start_service,
        stop_services,
        wait_serving,
    )

    out = Path(args.out)
    cfg = dataclasses.replace(
        StackConfig.on_free_ports(),
        log_dir=out / "logs",
        gateway_replicas=args.gateways,
        extra_args={"gateway": tuple(shlex.split(args.gateway_args))},
    )
    specs = [speaker_cache_spec(cfg), _talker_spec(cfg, args)]
    urls = []
    for i in range(args.gateways):
        http, grpc_port, metrics = cfg.gateway_ports(i)
        specs.append(
            gateway_spec(
                cfg,
                name="gateway" if i == 0 else f"gateway-{i}",
                http_port=http,
                grpc_port=grpc_port,
                metrics_port=metrics,
            )  # fmt: skip
        )
        urls.append(f"http://{cfg.host}:{http}")
    procs = []
    try:
        for spec in specs:
            procs.append(start_service(spec, cfg.log_dir))
        for proc in procs:
            wait_serving(proc, 120.0)
        cmd = [
            sys.executable, "-m", "benchmarks.client", "--url", ",".join(urls), "--task-type", "voice_clone",
            "--max-new-tokens", str(args.frames), "--fixed-length", "--processes", str(args.processes),
            "--weights", "none (paced stand-in talker)", "--tag", "relay", "--out", str(out), "--no-progress",
            *client_args,
        ]  # fmt: skip
        rc = subprocess.call(cmd)
        _save_gateway_metrics(procs, cfg.host, out)
        return rc
    finally:
        stop_services(procs, grace=5.0)


def _talker_spec(cfg: StackConfig, args: argparse.Namespace) -> ServiceSpec:
    """The paced stand-in talker (this module's `serve`) as a service of the stack `cfg`."""
    from services.launcher import ServiceSpec

    return ServiceSpec(
        "talker",
        "benchmarks.relay_capacity",
        (
            "serve",
            "--host",
            cfg.host,
            "--port",
            str(cfg.talker_port),
            "--frames",
            str(args.frames),
            "--first-audio-ms",
            str(args.first_audio_ms),
            "--speedup",
            str(args.speedup),
            "--lead-s",
            str(args.lead_s),
        ),  # fmt: skip
        f"{cfg.host}:{cfg.talker_port}",
    )


def _save_gateway_metrics(procs: Sequence[ServiceProcess], host: str, out: Path) -> None:
    """Each gateway's /metrics page into `out` (metrics-<name>.txt); a failure is told on stderr."""
    for proc in procs:
        if proc.name.startswith("gateway") and proc.spec.metrics_port:
            url = f"http://{host}:{proc.spec.metrics_port}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    (out / f"metrics-{proc.name}.txt").write_bytes(r.read())
            except OSError as exc:
                print(f"metrics of {proc.name} not saved: {exc}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.relay_capacity", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the paced stand-in talker")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50052)
    s.add_argument("--metrics-port", type=int, default=0)
    s.add_argument("--frames", type=int, default=125, help="frames per request without max_new_frames")
    s.add_argument("--first-audio-ms", type=float, default=50.0)
    s.add_argument(
        "--speedup", type=float, default=4.0, help="generation speed over real time, until the lead"
    )
    s.add_argument("--lead-s", type=float, default=4.0, help="how far ahead of playback a stream runs")
    r = sub.add_parser("run", help="the stack around the paced talker, and tts-bench through it")
    r.add_argument("--out", required=True)
    r.add_argument("--gateways", type=int, default=1)
    r.add_argument("--processes", type=int, default=1, help="client processes per level")
    r.add_argument(
        "--gateway-args",
        default="--max-streams 1024",
        help="extra flags for every gateway (as the H200 runs)",
    )
    r.add_argument("--frames", type=int, default=125)
    r.add_argument("--first-audio-ms", type=float, default=50.0)
    r.add_argument("--speedup", type=float, default=4.0)
    r.add_argument("--lead-s", type=float, default=4.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    client_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, client_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        asyncio.run(serve(args))
        return 0
    return run_stack(args, client_args)


if __name__ == "__main__":
    sys.exit(main())
