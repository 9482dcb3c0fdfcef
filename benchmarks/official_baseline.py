"""The official `qwen-tts` package's `generate_voice_clone` on the same random weights as our dummy load.

Writes a full-size random snapshot in the real folder layout from our dummy load
(`load_talker_bundle(<config>, load_format="dummy")`: talker, code predictor and speaker encoder
with the seeded dummy init; seeded random speech tokenizer at the full-size codec config; the tiny
test tokenizer, whose special tokens sit at the real ids, since the shipped configs carry no
vocabulary), loads it with `Qwen3TTSModel.from_pretrained`, and times `generate_voice_clone` (ICL,
a prebuilt voice-clone prompt of `--ref-frames` reference frames, so the reference encoders are
not timed) at each batch size (default 1 and 8), every request exactly `--frames` frames long
(the package hard-codes `min_new_tokens=2`: the talker's `generate` is wrapped to set
`min_new_tokens = max_new_tokens`). Reported per batch (median over `--repeats` runs after a
warm-up): the wall time of the whole call (talker + code predictor + speech-tokenizer decode), the
talker's `generate` alone, the per-frame step (talker time / frames) and the RTF (wall / audio
seconds of one request; < 1 is faster than real time), plus the aggregate real-time factor.

On the GPU machine the package runs from the wheels in `.whl_ref/` (git-ignored: carry the folder),
installed without dependencies into a separate folder put on PYTHONPATH (the machine's own torch
and torchaudio stay):

    pip install --no-deps --target /tmp/qwen_ref .whl_ref/*.whl
    PYTHONPATH=/tmp/qwen_ref:. python -m benchmarks.official_baseline --out run/official_baseline.json

Other runs:

    python -m benchmarks.official_baseline --model qwen3-tts-12hz-0.6b-base --batches 1,8,32
    python -m benchmarks.official_baseline --device cpu --tiny       # smoke run on a tiny snapshot
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.revision import git_revision
from qtts.model import load_talker_bundle

REPO_ROOT = Path(__file__).resolve().parent.parent
FRAME_S = 0.08
TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank today, and then it rests."
REF_TEXT = "This is the reference recording of my voice, read slowly and clearly."


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# -- the random snapshot ---------------------------------------------------------------------------
def write_speech_tokenizer(config_dir: Path, out: Path, seed: int) -> Path:
    """Seeded random speech tokenizer (Mimi encoder + our decoder layout) for `config_dir`'s config."""
    from safetensors.torch import save_file

    from qtts.model.codec_decoder import CodecDecoder, CodecDecoderConfig, init_dummy_weights
    from qtts.tiny_model.codec import random_mimi_encoder_state

    config = json.loads((config_dir / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    decoder = CodecDecoder(CodecDecoderConfig.from_dict(config["decoder_config"]))
    init_dummy_weights(decoder, seed)
    tensors = {f"decoder.{k}": v.contiguous() for k, v in decoder.state_dict().items()}
    tensors.update(
        {
            f"encoder.{k}": v.contiguous()
            for k, v in random_mimi_encoder_state(config["encoder_config"], seed).items()
        }
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(config_dir / name, out / name)
    return out


def write_random_snapshot(model: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A snapshot folder holding exactly the weights of `load_talker_bundle(model, load_format="dummy",
    seed=seed)`, in the official layout, loadable by `Qwen3TTSModel.from_pretrained`."""
    from safetensors.torch import save_file

    from qtts.tiny_model.tokenizer import write_tiny_tokenizer

    bundle = load_talker_bundle(model, device="cpu", dtype=dtype, load_format="dummy", seed=seed)
    snap = bundle.snapshot
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(snap.folder / name, out / name)
    sd = {f"talker.{k}": v for k, v in bundle.talker.state_dict().items()}
    sd.update({f"talker.code_predictor.{k}": v for k, v in bundle.code_predictor.state_dict().items()})
    if bundle.speaker_encoder is not None:
        sd.update({f"speaker_encoder.{k}": v for k, v in bundle.speaker_encoder.state_dict().items()})
    save_file(
        {k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    del sd, bundle
    if snap.has_tokenizer:
        from qtts.model.snapshot import TOKENIZER_FILES

        for name in TOKENIZER_FILES:
            shutil.copy(snap.folder / name, out / name)
    else:
        write_tiny_tokenizer(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps({"processor_class": "Qwen3TTSProcessor"}, indent=2)
    )
    write_speech_tokenizer(snap.speech_tokenizer_dir, out / "speech_tokenizer", seed)
    return out


def weights_match(official, ours) -> bool:
    """The official model holds our dummy weights (from_pretrained would silently re-initialise
    tensors it did not find): compare a few from each part."""
    pairs = [
        (official.model.talker.codec_head.weight, ours.talker.codec_head.weight),
        (official.model.talker.get_input_embeddings().weight, ours.talker.model.codec_embedding.weight),
        (official.model.talker.code_predictor.lm_head[0].weight, ours.code_predictor.lm_head[0].weight),
    ]
    if ours.speaker_encoder is not None:
        mine = list(ours.speaker_encoder.parameters())[0]
        theirs = list(official.model.speaker_encoder.parameters())[0]
        pairs.append((theirs, mine))
    return all(torch.equal(a.detach().cpu().float(), b.detach().cpu().float()) for a, b in pairs)


# -- timing ---------------------------------------------------------------------------------------
class Timed:
    """Wraps the official model for fixed-length runs and records the talker's generate time."""

    def __init__(self, model, device: str) -> None:
        self.model, self.device = model, device
        self.talker_s = 0.0
        self.frames: list[int] = []
        talker = model.model.talker
        orig_talker_generate = talker.generate

        @functools.wraps(orig_talker_generate)
        def fixed_length(*a, **k):
            k["min_new_tokens"] = k["max_new_tokens"]  # the package passes min_new_tokens=2
            return orig_talker_generate(*a, **k)

        talker.generate = fixed_length
        orig_generate = model.model.generate

        @functools.wraps(orig_generate)
        def timed_generate(*a, **k):
            _sync(device)
            t0 = time.perf_counter()
            out = orig_generate(*a, **k)
            _sync(device)
            self.talker_s = time.perf_counter() - t0
            self.frames = [int(c.shape[0]) for c in out[0]]
            return out

        model.model.generate = timed_generate

    def run(self, items: list, batch: int, frames: int, sample: bool) -> dict[str, Any]:
        _sync(self.device)
        t0 = time.perf_counter()
        wavs, sr = self.model.generate_voice_clone(
            text=[TEXT] * batch,
            language=["English"] * batch,
            voice_clone_prompt=items[:batch],
            max_new_tokens=frames + 1,  # the talker makes max_new_tokens - 1 frames
            do_sample=sample,
            subtalker_dosample=sample,
        )
        _sync(self.device)
        wall = time.perf_counter() - t0
        return {
            "wall_s": wall,
            "talker_s": self.talker_s,
            "frames": list(self.frames),
            "samples": [int(np.asarray(w).shape[-1]) for w in wavs],
            "sample_rate": int(sr),
        }


def voice_items(
    qt, bundle_info: dict[str, Any], count: int, ref_frames: int, device: str, dtype, seed: int
) -> list:
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(count):
        items.append(
            qt.VoiceClonePromptItem(
                ref_code=torch.randint(0, bundle_info["codebook_size"], (ref_frames, 16), generator=g).to(
                    device
                ),
                ref_spk_embedding=(torch.randn(bundle_info["hidden"], generator=g) * 0.02).to(device, dtype),
                x_vector_only_mode=False,
                icl_mode=True,
                ref_text=REF_TEXT,
            )
        )
    return items


def bench_batch(timed: Timed, items: list, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    timed.run(items, batch, min(args.frames, 4), args.sample)  # warm-up (allocator, kernels)
    runs = [timed.run(items, batch, args.frames, args.sample) for _ in range(args.repeats)]
    wall = statistics.median(r["wall_s"] for r in runs)
    talker = statistics.median(r["talker_s"] for r in runs)
    frames = runs[0]["frames"]
    audio_s = frames[0] * FRAME_S
    return {
        "batch": batch,
        "frames_per_request": frames,
        "audio_s_per_request": audio_s,
        "wall_s": wall,
        "talker_generate_s": talker,
        "decode_s": wall - talker,
        "step_ms": talker / frames[0] * 1e3,
        "wall_ms_per_frame": wall / frames[0] * 1e3,
        "rtf": wall / audio_s,
        "aggregate_x_real_time": batch * audio_s / wall,
        "runs": runs,
    }


def print_table(result: dict[str, Any]) -> None:
    print()
    print("| batch | frames | wall s | talker s | step ms (talker / frame) | RTF | aggregate x real time |")
    print("|---|---|---|---|---|---|---|")
    for r in result["batches"]:
        print(
            f"| {r['batch']} | {r['frames_per_request'][0]} | {r['wall_s']:.2f} | {r['talker_generate_s']:.2f} | "
            f"{r['step_ms']:.1f} | {r['rtf']:.2f} | {r['aggregate_x_real_time']:.2f} |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen3-tts-12hz-1.7b-base", help="shipped config name or snapshot folder"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny random snapshot and small sizes (CPU smoke run)"
    )
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--frames", type=int, default=None, help="frames per request (default 125 = 10 s)")
    ap.add_argument(
        "--ref-frames", type=int, default=None, help="reference frames of the voice prompt (default 100)"
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per batch (median; default 3)")
    ap.add_argument("--sample", action="store_true", help="sample (the package default) instead of greedy")
    ap.add_argument("--attn", default=None, help="attn_implementation passed to from_pretrained")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-dir", default=None, help="write (or reuse) the random snapshot here")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.frames = args.frames or (4 if args.tiny else 125)
    args.ref_frames = args.ref_frames or (6 if args.tiny else 100)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    if min(args.batches) < 1 or args.frames < 1 or args.ref_frames < 1 or args.repeats < 1:
        raise SystemExit("--batches, --frames, --ref-frames and --repeats must be >= 1")
    return args


def _run_batches(timed: Timed, items: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`bench_batch` for every --batches size in turn, each told on stdout."""
    batches = []
    with torch.inference_mode():
        for b in args.batches:
            res = bench_batch(timed, items, b, args)
            batches.append(res)
            print(
                f"batch {b}: {res['frames_per_request'][0]} frames, wall {res['wall_s']:.2f} s, step "
                f"{res['step_ms']:.1f} ms, RTF {res['rtf']:.2f}, aggregate {res['aggregate_x_real_time']:.2f}x",
                flush=True,
            )
    return batches


def _meta(
    args: argparse.Namespace,
    qt: Any,
    model_type: str,
    model_size: str,
    same_weights: bool,
    write_s: float,
    load_s: float,
) -> dict[str, Any]:
    """The result's conditions: model, device, versions, and the snapshot's write and load times."""
    return {
        "model": "tiny" if args.tiny else args.model,
        "model_type": model_type,
        "model_size": model_size,
        "device": torch.cuda.get_device_name()
        if str(args.device).startswith("cuda")
        else platform.processor() or "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "qwen_tts": getattr(qt, "__version__", "0.1.1"),
        "transformers": __import__("transformers").__version__,
        "git": git_revision(),
        "host": platform.node(),
        "weights": "dummy (our seeded random init, saved in the official layout)",
        "weights_match_ours": same_weights,
        "snapshot_write_s": write_s,
        "load_s": load_s,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("official_baseline needs a CUDA GPU (or --device cpu --tiny)")
    from tests.official import import_qwen_tts  # real torchaudio if it imports, else stand-ins

    qt = import_qwen_tts()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.model
        if args.tiny:
            from qtts.tiny_model import build_tiny_snapshot

            source = str(build_tiny_snapshot(Path(tmp) / "qwen3-tts-tiny-base", "base", seed=args.seed))
        folder = Path(args.snapshot_dir) if args.snapshot_dir else Path(tmp) / "random-snapshot"
        t0 = time.perf_counter()
        if not (folder / "model.safetensors").is_file():
            write_random_snapshot(source, folder, args.seed, dtype)
        write_s = time.perf_counter() - t0
        ours = load_talker_bundle(folder, device="cpu", dtype=dtype)
        t0 = time.perf_counter()
        kw = {"dtype": dtype, "device_map": args.device}
        if args.attn:
            kw["attn_implementation"] = args.attn
        model = qt.Qwen3TTSModel.from_pretrained(str(folder), **kw)
        model.model.eval()
        load_s = time.perf_counter() - t0
        same_weights = weights_match(model, ours)
        info = {"codebook_size": ours.info.codebook_size, "hidden": ours.config.talker.decoder.hidden_size}
        model_type, model_size = ours.info.model_type, ours.info.model_size
        del ours
    items = voice_items(qt, info, max(args.batches), args.ref_frames, args.device, dtype, args.seed)
    batches = _run_batches(Timed(model, args.device), items, args)
    result = {
        "meta": _meta(args, qt, model_type, model_size, same_weights, write_s, load_s),
        "settings": {
            "batches": args.batches,
            "frames": args.frames,
            "ref_frames": args.ref_frames,
            "repeats": args.repeats,
            "sample": args.sample,
            "text": TEXT,
        },
        "batches": batches,
    }
    print_table(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
