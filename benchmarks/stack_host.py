"""The whole stack's host side with the GPUs stood in: the real gateway in front of
`talker_host`'s talker (its engine in a process of its own, as on a GPU) and `code2wav_host`'s
code2wav, driven by the real benchmark client over HTTP or gRPC.

The two harnesses beside it drive one service each as its caller would; this one runs what a user
runs, so the gateway's part shows too: its HTTP or gRPC front, its refusals from the talkers'
published room (a 429 or RESOURCE_EXHAUSTED that should reach the client in milliseconds), its
relay of every chunk to the client. The talker's model is the stand-in whose frame step sleeps for
the H200's (`--step-ms` plus `--step-us-per-stream` a stream), a preset voice; code2wav's decoder
sleeps 27 us a frame + 500 us a call. Everything shares this machine's cores with the client, so
its numbers are the host sides' on this machine, not the H200's.

The run's folder gets the client's results (`results.json`, `.md`), every service's `/metrics`
after the sweep (`metrics-<service>.txt`) and their logs; `benchmarks/stack_summary.py` prints
them at the end, as `run_h200.sh stacks` does on the GPU.

    python -m benchmarks.stack_host --out run/stack_host --client-args "--concurrency 256 512"

`--idle-first N` sends N requests of 2 s one at a time before the sweep, into `idle/`, as
`launch_gpu_stack.sh`'s IDLE_FIRST does on the GPU: idle first audio, and what the services learn
while idle carried into the sweep's first burst.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from benchmarks.code2wav_host import stop, wait_ready
from benchmarks.stack_summary import summary
from benchmarks.talker_host import VOICE, wait_serving

# --idle-first's client: n requests of 2 s, one at a time.
IDLE_ARGS = (
    "--task-type custom_voice --voice {voice} --no-ref-audio --concurrency 1 --num-requests {n} "
    "--max-new-tokens 25 --fixed-length --warmup 0"
)
# The client's flags unless --client-args replaces them: 10 s requests of the stand-in's preset
# voice in a closed loop, refused clients retrying after the Retry-After they are given.
CLIENT_ARGS = (
    "--task-type custom_voice --voice {voice} --no-ref-audio --concurrency 256 512 --num-requests 1024 "
    "--max-new-tokens 125 --fixed-length --time-limit 40 --retry-after --refusal-probe-s 0.1"
)


def services(args: argparse.Namespace, out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, metrics port) of each service, in the order they start."""
    py = [sys.executable, "-m"]
    code2wav = py + ["benchmarks.code2wav_host", "serve", "--port", str(args.code2wav_port)]
    code2wav += ["--metrics-port", str(args.code2wav_metrics_port), "--code2wav-args", args.code2wav_args]
    talker = py + ["benchmarks.talker_host", "serve", "--engine-process", "--port", str(args.talker_port)]
    talker += [
        "--metrics-port",
        str(args.talker_metrics_port),
        "--code2wav",
        f"127.0.0.1:{args.code2wav_port}",
    ]
    talker += ["--step-ms", str(args.step_ms), "--step-us-per-stream", str(args.step_us_per_stream)]
    talker += ["--prefill-ms", str(args.prefill_ms)]
    talker += ["--talker-args", args.talker_args]
    gateway = py + [
        "services.gateway",
        "--http-port",
        str(args.http_port),
        "--grpc-port",
        str(args.grpc_port),
    ]
    gateway += ["--metrics-port", str(args.gateway_metrics_port), "--talker", f"127.0.0.1:{args.talker_port}"]
    # No speaker_cache: the stand-in speaks a preset voice only.
    gateway += ["--speaker-cache", f"127.0.0.1:{args.speaker_cache_port}", *shlex.split(args.gateway_args)]
    return [
        ("code2wav", code2wav, args.code2wav_metrics_port),
        ("talker", talker, args.talker_metrics_port),
        ("gateway", gateway, args.gateway_metrics_port),
    ]


def scrape_all(out: Path, ports: dict[str, int]) -> None:
    for name, port in ports.items():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                (out / f"metrics-{name}.txt").write_bytes(r.read())
        except OSError as exc:
            print(f"metrics of {name} (:{port}) not scraped: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for name, cmd, metrics_port in services(args, out):
            log = open(out / f"{name}.log", "wb")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            wait_ready(metrics_port, procs[-1], name=name)
            if name == "talker":
                wait_serving(f"127.0.0.1:{args.talker_port}", procs[-1])
        wait_serving(f"127.0.0.1:{args.grpc_port}", procs[-1], name="the gateway")  # found its talker
        metrics = {
            "gateway": args.gateway_metrics_port,
            "talker": args.talker_metrics_port,
            "code2wav": args.code2wav_metrics_port,
        }

        def client(folder: Path, flags: str, tag: str) -> list[str]:
            cmd = [sys.executable, "-m", "benchmarks.client", "--url", f"http://127.0.0.1:{args.http_port}"]
            cmd += ["--grpc-target", f"127.0.0.1:{args.grpc_port}", "--protocol", args.protocol]
            cmd += ["--out", str(folder), "--tag", tag, "--no-plots", "--no-progress"]
            return cmd + shlex.split(flags)

        if args.idle_first > 0:
            idle = IDLE_ARGS.format(voice=VOICE, n=args.idle_first)
            code = subprocess.call(client(out / "idle", idle, "stack-host-idle"), env=env)
            print(f"idle client exited {code}", file=sys.stderr)
            scrape_all(out / "idle", metrics)
        started = time.monotonic()
        code = subprocess.call(client(out, args.client_args.format(voice=VOICE), "stack-host"), env=env)
        print(f"client exited {code} after {time.monotonic() - started:.0f} s", file=sys.stderr)
        scrape_all(out, metrics)
    finally:
        stop(procs)
        for log in logs:
            log.close()
    print(summary([out]))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the run's folder")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument(
        "--client-args", default=CLIENT_ARGS, help="benchmark client flags ({voice}: the preset)"
    )
    parser.add_argument(
        "--idle-first",
        type=int,
        default=0,
        help="requests of 2 s sent one at a time before the sweep (into idle/)",
    )
    parser.add_argument("--talker-args", default="", help="more talker flags")
    parser.add_argument("--code2wav-args", default="--max-batch 256 --max-states 2048")
    parser.add_argument("--gateway-args", default="", help="more gateway flags")
    parser.add_argument("--step-ms", type=float, default=4.4, help="frame step at batch 1")
    parser.add_argument("--step-us-per-stream", type=float, default=20.0, help="frame step per stream")
    parser.add_argument(
        "--prefill-ms", type=float, default=0.0, help="a step's extra time per request prefilled in it"
    )
    parser.add_argument("--http-port", type=int, default=8460)
    parser.add_argument("--grpc-port", type=int, default=50461)
    parser.add_argument("--gateway-metrics-port", type=int, default=9460)
    parser.add_argument("--talker-port", type=int, default=50462)
    parser.add_argument("--talker-metrics-port", type=int, default=9462)
    parser.add_argument("--code2wav-port", type=int, default=50463)
    parser.add_argument("--code2wav-metrics-port", type=int, default=9463)
    parser.add_argument("--speaker-cache-port", type=int, default=50464)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
