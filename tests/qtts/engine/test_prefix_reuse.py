"""Prompt-prefix KV reuse end to end: prompts built by the model core carry their prefix key, and
the engine reuses the voice's KV without being told (float64 tiny snapshot, greedy)."""

from __future__ import annotations

import pytest
import torch

from qtts.engine import GraphEngine, GraphEngineConfig, RunnerConfig
from qtts.model import SamplingParams, SynthesisSpec, VoicePrompt, load_talker_bundle
from qtts.tiny_model import build_tiny_snapshot
from tests.qtts.engine.test_engine_cpu import same_outputs

GREEDY = SamplingParams(greedy=True)
REF_TEXT = "The reference clip says this."
TEXTS = ["Hello world, the first request.", "Another sentence for the second one.", "Third text here."]
FRAMES = 5


@pytest.fixture(scope="module")
def base_bundle(tmp_path_factory):
    snap = build_tiny_snapshot(tmp_path_factory.mktemp("prefix") / "qwen3-tts-tiny-base", "base", seed=0)
    return load_talker_bundle(snap, dtype=torch.float64)


def voice(bundle, seed: int, x_vector_only: bool = False) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(
        x_vector=torch.randn(bundle.config.talker.decoder.hidden_size, generator=g),
        ref_codes=None if x_vector_only else torch.randint(0, 2048, (60, 16), generator=g),
        ref_text=None if x_vector_only else REF_TEXT,
        x_vector_only=x_vector_only,
    )


def prompt(bundle, text: str, vp: VoicePrompt):
    return bundle.build_prompt(
        SynthesisSpec(text=text, task="voice_clone", language="english", voice_prompt=vp)
    )


def engine(bundle, cache_bytes: int) -> GraphEngine:
    cfg = RunnerConfig(max_batch=4, max_len=128, max_trailing=64, prefix_cache_bytes=cache_bytes)
    return GraphEngine(bundle, config=GraphEngineConfig(runner=cfg))


def run(eng: GraphEngine, requests: list[tuple[str, object]], join_every: int = 2) -> dict[str, list]:
    """Requests join one every `join_every` steps; returns every request's outputs."""
    got: dict[str, list] = {}
    step = 0
    pending = list(requests)
    while pending or eng.has_work:
        if pending and step % join_every == 0:
            rid, p = pending.pop(0)
            eng.add(rid, p, GREEDY, FRAMES)
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
        step += 1
    return got


def test_same_voice_hits_the_prefix_cache_and_keeps_the_codes(base_bundle):
    vp = voice(base_bundle, seed=1)
    prompts = [prompt(base_bundle, t, vp) for t in TEXTS]
    other = prompt(base_bundle, TEXTS[0], voice(base_bundle, seed=2))
    assert (
        all(p.prefix_key == prompts[0].prefix_key for p in prompts)
        and other.prefix_key != prompts[0].prefix_key
    )
    requests = [("a", prompts[0]), ("b", prompts[1]), ("o", other), ("c", prompts[2])]

    want = run(engine(base_bundle, 0), requests)
    assert engine(base_bundle, 0).runner.prefix_cache is None

    eng = engine(base_bundle, 1 << 22)
    starts: dict[str, int] = {}
    prefill = eng.runner.prefill

    def record(chunks):
        for c in chunks:
            starts.setdefault(c.seq.request_id, c.start)
        prefill(chunks)

    eng.runner.prefill = record
    got = run(eng, requests)

    cache = eng.runner.prefix_cache
    assert cache.hits == 2 and cache.misses == 2 and len(cache) == 2  # b and c hit a's voice
    plen = prompts[0].prefix_len
    assert 0 < plen < prompts[1].embeds.shape[0] - 1
    assert starts == {"a": 0, "o": 0, "b": plen, "c": plen}  # prefill resumed after the cached prefix
    assert cache.get(prompts[0].prefix_key)[0].shape[2] == plen
    for rid in ("a", "b", "o", "c"):
        assert len(got[rid]) == FRAMES or got[rid][-1].finish_reason == "stop"
        assert same_outputs(got[rid], want[rid]), rid


def test_explicit_arguments_override_the_prompt_and_short_prefixes_stay_out(base_bundle):
    xv = voice(base_bundle, seed=3, x_vector_only=True)
    short = [prompt(base_bundle, t, xv) for t in TEXTS[:2]]
    assert short[0].prefix_key is None and short[0].prefix_len > 0
    eng = engine(base_bundle, 1 << 22)
    run(eng, [("x0", short[0]), ("x1", short[1])])
    assert len(eng.runner.prefix_cache) == 0 and eng.runner.prefix_cache.hits == 0

    # A caller-supplied key wins over the prompt's (None) key.
    eng = engine(base_bundle, 1 << 22)
    for i, p in enumerate(short):
        eng.add(f"k{i}", p, GREEDY, FRAMES, prefix_key="caller-voice", prefix_len=p.prefix_len)
        while eng.has_work:
            eng.step()
    assert eng.runner.prefix_cache.hits == 1 and "caller-voice" in eng.runner.prefix_cache
