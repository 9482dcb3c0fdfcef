"""How long a refusal takes to reach its client while the gateway relays many streams (issue #26).

A stand-in talker (`talker`) streams paced tone audio (benchmarks/relay_capacity.py) and publishes
its room through `GetCapacity`: `--room` streams, less those running. In front of it the real
gateway (a process); behind the gateway, at once:

- a loaded client (`load`, its own process): the benchmark client's HTTP recorder at a closed loop of
  `--concurrency` > `--room` voice clones, so the level starts with a burst past the room, as a
  `benchmarks.client` level does; its refused requests are timed as `benchmarks.client` times them;
- an idle prober (this process): every `--probe-every-s`, one voice clone (its ~190 KB body
  included) and one `GET /livez`, each timed alone, so a refusal's latency is seen without a busy
  client's own event loop in it;
- the gateway's access log: each 429's server-side time, from the app's first look at the request
  to its answer.

    python -m benchmarks.refusal_latency run --out run/refusal --room 100 --concurrency 150

`burst` is a closed-loop level's opening alone, repeated: one client process sends `--requests`
voice clones at once through the same stack (`--room` of them let in), waits for every one to end,
and does it again `--bursts` times. Each refused request is timed as `benchmarks.client` times it,
beside the admitted ones' first audio and the gateway's CPU a burst, so the refusals' wait behind
the admitted requests' work (body, validation, the talker call) shows against a burst that is all
refused (`--room 0`):

    python -m benchmarks.refusal_latency burst --out run/burst --room 48 --requests 96
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import httpx
import numpy as np

from benchmarks.relay_capacity import PacedTalker
from benchmarks.transport import POOLS
from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name

ACCESS_429 = re.compile(r"POST /v1/audio/speech 429 ([0-9.]+)s")


class RoomTalker(PacedTalker):
    """The paced talker, publishing `room` less its running streams as its room."""

    def __init__(self, *, room: int, **kwargs):
        super().__init__(**kwargs)
        self.room = room
        self.active = 0

    async def GetCapacity(self, request, context):  # noqa: N802 - gRPC method name
        return talker_pb2.GetCapacityResponse(accept=max(0, self.room - self.active), retry_after_s=1)

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        self.active += 1
        try:
            async for message in super().Generate(request, context):
                yield message
        finally:
            self.active -= 1


async def serve_talker(args: argparse.Namespace) -> None:
    host = GrpcServiceHost(
        service_names=[service_full_name(talker_pb2, "TalkerService")],
        host=args.host,
        port=args.port,
        metrics_port=0,
        drain_seconds=1.0,
    )
    talker = RoomTalker(
        room=args.room, frames=args.frames, first_audio_s=0.05, speedup=args.speedup, lead_s=args.lead_s
    )
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(talker, host.server)
    await host.start()
    await host.set_serving()
    await host.serve_until_signal()


def _options(frames: int):
    from benchmarks.reference_audio import synthetic_reference_wav
    from benchmarks.transport import SynthesisOptions

    return SynthesisOptions(
        task_type="voice_clone",
        ref_audio=synthetic_reference_wav(3.0),
        ref_text="A reference clip of three seconds.",
        max_new_tokens=frames,
        fixed_length=True,
    )


async def _lag_monitor(samples: list[float], period_s: float = 0.01) -> None:
    """How late this process's event loop wakes a 10 ms sleep (its own lag)."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        samples.append(time.perf_counter() - t - period_s)


async def load(args: argparse.Namespace) -> None:
    """The loaded client: a closed loop through benchmarks.transport.HttpSynthesizer."""
    from benchmarks.loadgen import run_closed_loop
    from benchmarks.transport import HttpSynthesizer

    synth = HttpSynthesizer(args.url, _options(args.frames), pools=args.pools)
    lag: list[float] = []
    monitor = asyncio.create_task(_lag_monitor(lag))
    run = await run_closed_loop(
        lambda i: synth.synthesize(i, 0, "Hello there, this is a refusal latency run."),
        concurrency=args.concurrency,
        num_requests=args.requests,
        deadline=time.perf_counter() + args.duration_s,
    )
    monitor.cancel()
    await synth.aclose()
    records = [
        {"start_s": r.start_s, "e2e_s": r.e2e_s, "status": r.status, "error": r.error, "ttfa_s": r.ttfa_s}
        for r in run.records
    ]
    Path(args.out).write_text(json.dumps({"records": records, "loop_lag_s": lag, "wall_s": run.wall_s}))


async def send_bursts(args: argparse.Namespace) -> None:
    """The burst client: `--bursts` times, `--requests` voice clones at once, each burst after the
    last one's streams all ended (so the room is whole again)."""
    from benchmarks.transport import HttpSynthesizer

    synth = HttpSynthesizer(args.url, _options(args.frames), pools=args.pools)
    await synth.warm()
    out = []
    for b in range(args.bursts):
        t0 = time.perf_counter()
        recs = await asyncio.gather(
            *(
                synth.synthesize(b * args.requests + i, 0, "Hello there, a burst.")
                for i in range(args.requests)
            )
        )
        out.append(
            {
                "wall_s": time.perf_counter() - t0,
                "records": [
                    {"status": r.status, "e2e_s": r.e2e_s, "ttfa_s": r.ttfa_s, "sent_s": r.start_s - t0}
                    for r in recs
                ],
            }
        )
        await asyncio.sleep(args.pause_s)
    await synth.aclose()
    Path(args.out).write_text(json.dumps({"bursts": out}))


def burst_report(bursts: list[dict], gateway_cpu_s: list[float]) -> dict:
    """Per burst and over all: the refused requests' time, the admitted ones' first audio, counts."""
    rows = []
    for b, cpu in zip(bursts, gateway_cpu_s, strict=True):
        refused = [r["e2e_s"] for r in b["records"] if r["status"] == "429"]
        ttfa = [r["ttfa_s"] for r in b["records"] if r["status"] == "200" and r["ttfa_s"] is not None]
        rows.append(
            {
                "refused": len(refused),
                "admitted": sum(1 for r in b["records"] if r["status"] == "200"),
                "other": sum(1 for r in b["records"] if r["status"] not in ("200", "429")),
                "refused_ms": _pcts(refused),
                "ttfa_ms": _pcts(ttfa),
                "gateway_cpu_s": round(cpu, 3),
            }
        )
        print(
            f"burst: {rows[-1]['admitted']} admitted, {rows[-1]['refused']} refused, "
            f"{rows[-1]['other']} other; refused {rows[-1]['refused_ms']}; first audio {rows[-1]['ttfa_ms']}; "
            f"gateway CPU {cpu:.2f} s"
        )
    every = [r["e2e_s"] for b in bursts for r in b["records"] if r["status"] == "429"]
    summary = {"bursts": rows, "refused_ms_all": _pcts(every)}
    print(f"all bursts, refused: {summary['refused_ms_all']}")
    return summary


def client_command(
    command: str, url: str, out: Path, args: argparse.Namespace, flags: Sequence[str]
) -> list[str]:
    """This module's `command` as a process against `url`, writing `out`, with `args`' `flags`."""
    cmd = [sys.executable, "-m", "benchmarks.refusal_latency", command, "--url", url, "--out", str(out)]
    for name in flags:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return cmd


def run_bursts(args: argparse.Namespace) -> int:
    """The room stack; the burst client through it, the gateway's CPU counted per burst."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sent_path = out / "bursts.json"
    with room_stack(out, args) as (url, gateway_pid, _log, _grpc):
        cmd = client_command(
            "burst-client", url, sent_path, args, ("requests", "bursts", "frames", "pause_s", "pools")
        )
        cpu0 = cpu_seconds(gateway_pid)
        subprocess.run(cmd, check=True)
        cpu_all = cpu_seconds(gateway_pid) - cpu0
    bursts = json.loads(sent_path.read_text())["bursts"]
    # The gateway's CPU over the whole run, shared out by each burst's wall time (bursts only,
    # the pauses between them idle): a per-burst figure without a sampler in the gateway.
    walls = [b["wall_s"] for b in bursts]
    cpu = [cpu_all * w / sum(walls) for w in walls]
    summary = burst_report(bursts, cpu)
    summary["gateway_cpu_s_total"] = round(cpu_all, 3)
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1))
    return 0


async def probe(url: str, every_s: float, stop: asyncio.Event) -> dict[str, list]:
    """One voice clone and one /livez at a time, every `every_s`, from an otherwise idle loop."""
    from benchmarks.transport import HttpSynthesizer

    synth = HttpSynthesizer(url, _options(1))  # one frame: a probe let in ends at once
    out: dict[str, list] = {"speech": [], "livez": []}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        while not stop.is_set():
            t = time.perf_counter()
            await c.get("/livez")
            out["livez"].append(time.perf_counter() - t)
            rec = await synth.synthesize(len(out["speech"]), 0, "A probe.")
            out["speech"].append((rec.start_s, rec.e2e_s, rec.status))
            await asyncio.sleep(every_s)
    await synth.aclose()
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pcts(values: Sequence[float]) -> str:
    if not values:
        return "n=0"
    p50, p95, p99 = np.percentile(np.asarray(values) * 1e3, [50, 95, 99])
    return f"n={len(values)} p50 {p50:.0f} / p95 {p95:.0f} / p99 {p99:.0f} / max {max(values) * 1e3:.0f} ms"


def report(loaded: dict, probed: dict, server_429_s: list[float]) -> dict:
    refused = [r for r in loaded["records"] if r["status"] == "429"]
    ok = [r for r in loaded["records"] if r["status"] == "200"]
    probes = [p for p in probed["speech"] if p[2] == "429"]
    summary = {
        "loaded client, refused (its own timing, as benchmarks.client)": _pcts([r["e2e_s"] for r in refused]),
        "loaded client, TTFA of the admitted": _pcts([r["ttfa_s"] for r in ok if r["ttfa_s"] is not None]),
        "loaded client, its event loop's lag": _pcts(loaded["loop_lag_s"]),
        "idle prober, refused voice clones": _pcts([p[1] for p in probes]),
        "idle prober, GET /livez": _pcts(probed["livez"]),
        "gateway access log, 429s (server side)": _pcts(server_429_s),
        "counts": {"loaded ok": len(ok), "loaded refused": len(refused), "probes refused": len(probes)},
    }
    for k, v in summary.items():
        print(f"{k:>62}: {v}")
    return summary


@contextlib.contextmanager
def room_stack(out: Path, args: argparse.Namespace) -> Iterator[tuple[str, int, Path, str]]:
    """speaker_cache, the room talker (`--room` ...) and one gateway (`--gateway-args`) as
    processes, logs under `out`: yields the gateway's URL, its pid, its log and its gRPC address;
    stops them after."""
    from services.launcher import (
        ServiceSpec,
        StackConfig,
        gateway_spec,
        speaker_cache_spec,
        start_service,
        stop_services,
        wait_serving,
    )

    cfg = dataclasses.replace(
        StackConfig.on_free_ports(),
        log_dir=out / "logs",
        extra_args={"gateway": tuple(shlex.split(args.gateway_args))},
    )
    talker = ServiceSpec(
        "talker",
        "benchmarks.refusal_latency",
        ("talker", "--host", cfg.host, "--port", str(cfg.talker_port), "--room", str(args.room),
         "--frames", str(args.frames), "--speedup", str(args.speedup), "--lead-s", str(args.lead_s)),
        f"{cfg.host}:{cfg.talker_port}",
    )  # fmt: skip
    procs = []
    try:
        for spec in (speaker_cache_spec(cfg), talker, gateway_spec(cfg)):
            procs.append(start_service(spec, cfg.log_dir))
        for proc in procs:
            wait_serving(proc, 120.0)
        yield (
            f"http://{cfg.host}:{cfg.http_port}",
            procs[-1].popen.pid,
            cfg.log_dir / "gateway.log",
            f"{cfg.host}:{cfg.grpc_port}",
        )
    finally:
        stop_services(procs, grace=5.0)


def run(args: argparse.Namespace) -> int:
    """The room stack; the loader and the prober through it; the gateway's access log after."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded_path = out / "loaded.json"
    with room_stack(out, args) as (url, gateway_pid, gateway_log, _grpc):
        flags = ("concurrency", "requests", "frames", "duration_s", "pools")
        cmd = client_command("load", url, loaded_path, args, flags)
        cpu0, t0 = cpu_seconds(gateway_pid), time.perf_counter()
        loader = subprocess.Popen(cmd)

        async def probe_while_loaded() -> dict:
            stop = asyncio.Event()
            task = asyncio.create_task(probe(url, args.probe_every_s, stop))
            while loader.poll() is None:
                await asyncio.sleep(0.2)
            stop.set()
            return await task

        probed = asyncio.run(probe_while_loaded())
        gateway_cpu = (cpu_seconds(gateway_pid) - cpu0) / (time.perf_counter() - t0)
    if loader.returncode != 0:
        print(f"the loader failed ({loader.returncode})", file=sys.stderr)
        return 1
    server = [float(m) for m in ACCESS_429.findall(gateway_log.read_text(errors="replace"))]
    summary = report(json.loads(loaded_path.read_text()), probed, server)
    summary["gateway CPU (cores) while loaded"] = round(gateway_cpu, 3)
    print(f"{'gateway CPU (cores) while loaded':>62}: {gateway_cpu:.2f}")
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1))
    return 0


def _stand_in_flags(p: argparse.ArgumentParser, room: int) -> None:
    """The stand-in talker's flags: the room it publishes, its streams' length and pace."""
    p.add_argument("--room", type=int, default=room, help="streams the talker publishes room for")
    p.add_argument("--frames", type=int, default=125)
    p.add_argument("--speedup", type=float, default=4.0)
    p.add_argument("--lead-s", type=float, default=4.0)


def _stack_parser(
    sub: argparse._SubParsersAction, name: str, help: str, room: int
) -> argparse.ArgumentParser:
    """A subcommand that starts the room stack (`room_stack`): its folder and the stand-in's and
    the gateway's flags."""
    c = sub.add_parser(name, help=help)
    c.add_argument("--out", required=True)
    _stand_in_flags(c, room)
    c.add_argument("--gateway-args", default="--max-streams 1024", help="extra flags for the gateway")
    return c


def _client_parser(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A client subcommand with the flags both clients take (the stack's command line builds them
    with `client_command`)."""
    c = sub.add_parser(name, help=help)
    c.add_argument("--url", required=True)
    c.add_argument("--requests", type=int, required=True)
    c.add_argument("--frames", type=int, default=125)
    c.add_argument("--pools", type=int, default=POOLS)
    c.add_argument("--out", required=True)
    return c


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.refusal_latency", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("talker", help="the stand-in talker publishing its room")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=50052)
    _stand_in_flags(t, room=100)
    ld = _client_parser(sub, "load", "the loaded client (a closed loop)")
    ld.add_argument("--concurrency", type=int, required=True)
    ld.add_argument("--duration-s", type=float, default=20.0)
    r = _stack_parser(sub, "run", "the stack, the loader and the prober", room=100)
    r.add_argument("--concurrency", type=int, default=150, help="the loader's closed-loop streams")
    r.add_argument("--requests", type=int, default=100_000, help="the loader's requests at most")
    r.add_argument("--duration-s", type=float, default=20.0, help="how long the loader runs")
    r.add_argument("--pools", type=int, default=POOLS, help="the loader's connection pools (1: one)")
    r.add_argument("--probe-every-s", type=float, default=0.1)
    bc = _client_parser(sub, "burst-client", "the burst client")
    bc.add_argument("--bursts", type=int, required=True)
    bc.add_argument("--pause-s", type=float, default=1.0)
    b = _stack_parser(sub, "burst", "the stack and a level's opening burst, repeated", room=48)
    b.add_argument("--requests", type=int, default=96, help="voice clones sent at once, a burst")
    b.add_argument("--bursts", type=int, default=5)
    b.add_argument("--pause-s", type=float, default=1.0, help="idle time after each burst's streams end")
    b.add_argument("--pools", type=int, default=POOLS, help="the client's connection pools")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "talker":
        asyncio.run(serve_talker(args))
        return 0
    if args.command == "load":
        asyncio.run(load(args))
        return 0
    if args.command == "burst-client":
        asyncio.run(send_bursts(args))
        return 0
    if args.command == "burst":
        return run_bursts(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
