"""Text streamed into a running request: word-safe tokenisation, the open prompt, the eager
generator taking appended text and waiting (not ending) while the text runs dry."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from qtts.model import EagerGenerator, SamplingParams, SynthesisSpec
from qtts.model.open_text import OpenText
from qtts.model.text_feed import TextFeed, TextPieces, pre_token_starts
from qtts.request.errors import InvalidArgument

TEXTS = [
    "Hello there, this is a longer text. It's 3.14 dollars!\nAnd more words follow here.",
    "你好，世界。今天天气很好，我们去公园散步吧！",
    "  spaces\tand\n\nnew lines 1234567890 don't  stop. Bonjour le monde.",
]
GREEDY = SamplingParams(greedy=True, subtalker_greedy=True, min_new_tokens=10**6)


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def bundle64(tiny_snapshot_factory):
    """float64: embeddings computed per piece round differently in the last bits than the whole
    text's (other GEMM shapes); in float64 that never flips a greedy argmax of the tiny model."""
    from qtts.model import load_talker_bundle

    return {
        kind: load_talker_bundle(tiny_snapshot_factory(kind), dtype=torch.float64)
        for kind in ("base", "voice_design")
    }


def specs(bundle64) -> dict[str, tuple[object, SynthesisSpec]]:
    base = bundle64["base"]
    rng = np.random.RandomState(0)
    icl = base.compute_voice_prompt((rng.randn(72000) * 0.1).astype(np.float32), "A short reference.", False)
    xvec = dataclasses.replace(icl, ref_codes=None, ref_text=None, x_vector_only=True)
    design = bundle64["voice_design"]
    return {
        "icl": (base, SynthesisSpec(text="", task="voice_clone", voice_prompt=icl)),
        "x_vector": (base, SynthesisSpec(text="", task="voice_clone", voice_prompt=xvec)),
        "design": (design, SynthesisSpec(text="", task="voice_design", instruct="calm", streaming_text=True)),
    }


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 3, 8])
def test_pieces_hand_out_a_prefix_of_the_whole_texts_ids(bundle64, text, size):
    tok = bundle64["base"].prompt_builder
    whole = tok.role_and_target_ids(text)
    pieces = TextPieces(tok.role_and_target_ids, pre_token_starts(tok.tokenizer), tok.text_ids)
    out: list[int] = []
    for piece in pieces_of(text, size):
        out += pieces.push(piece)
        assert out == whole[: len(out)]
    assert out + pieces.finish() == whole


def test_a_long_text_in_word_pieces_is_tokenised_in_linear_time(bundle64):
    tok = bundle64["base"].prompt_builder
    text = " ".join(f"word{i % 50}" for i in range(600))  # about 4,000 characters
    seen = []

    def counted(fn):
        return lambda t: seen.append(len(t)) or fn(t)

    pieces = TextPieces(
        counted(tok.role_and_target_ids), pre_token_starts(tok.tokenizer), counted(tok.text_ids)
    )
    out = []
    for word in text.split(" "):
        out += pieces.push(word + " ")
    assert out + pieces.finish() == tok.role_and_target_ids(text)
    assert sum(seen) < 10 * len(text)  # the whole text again at every piece would be ~300x


def test_the_last_word_is_held_back_until_it_is_complete(bundle64):
    tok = bundle64["base"].prompt_builder
    pieces = TextPieces(tok.role_and_target_ids, pre_token_starts(tok.tokenizer), tok.text_ids)
    pieces.push("Hello wor")
    assert pieces.committed_text == "Hello"
    pieces.push("ld")
    assert pieces.committed_text == "Hello"  # "world" may still grow
    pieces.push(" again")
    assert pieces.committed_text == "Hello world"
    assert pieces.ids + pieces.finish() == tok.role_and_target_ids("Hello world again")


def test_whitespace_at_the_very_end_goes_as_from_a_stripped_whole_text(bundle64):
    tok = bundle64["base"].prompt_builder
    pieces = TextPieces(tok.role_and_target_ids, pre_token_starts(tok.tokenizer), tok.text_ids)
    out = pieces.push("Hello there ") + pieces.push("again  ")
    assert out + pieces.finish(" \n") == tok.role_and_target_ids("Hello there again")


@pytest.mark.parametrize("mode", ["icl", "x_vector", "design"])
def test_open_prompt_and_appended_text_equal_the_whole_texts_prompt(bundle64, mode):
    bundle, spec = specs(bundle64)[mode]
    text = TEXTS[0] + " " + TEXTS[0]
    whole = bundle.build_prompt(dataclasses.replace(spec, text=text))
    open_ = OpenText(bundle.prompt_builder, spec)
    prompts = []
    pieces = pieces_of(text, 5)
    for i, piece in enumerate(pieces):
        if (p := open_.push(piece, final=i == len(pieces) - 1)) is not None:
            prompts.append(p)
    assert len(prompts) == 1
    prompt, feed = prompts[0], prompts[0].text_feed
    assert feed is not None and feed.closed
    assert torch.equal(prompt.embeds, whole.embeds)
    chunks, _ = feed.chunks_from(0)
    torch.testing.assert_close(torch.cat([prompt.trailing, *chunks]), whole.trailing, atol=1e-12, rtol=0)
    assert (feed.max_frames, feed.default_max_frames, feed.num_text_tokens) == (
        whole.max_frames,
        whole.default_max_frames,
        whole.num_text_tokens,
    )


def test_icl_prompt_waits_until_the_text_passes_the_reference_frames(bundle64):
    bundle, spec = specs(bundle64)["icl"]
    open_ = OpenText(bundle.prompt_builder, spec)
    assert open_.push("Hi there ") is None  # shorter than the reference: a whole text would pad
    short = OpenText(bundle.prompt_builder, spec)
    short.push("Hi there ")
    prompt = short.push("again.", final=True)  # ends before it could start: a whole-text prompt
    whole = bundle.build_prompt(dataclasses.replace(spec, text="Hi there again."))
    assert prompt.text_feed is None and torch.equal(prompt.embeds, whole.embeds)


def test_open_text_refuses_non_streaming_text_and_text_past_its_room(bundle64):
    bundle, spec = specs(bundle64)["design"]
    with pytest.raises(InvalidArgument, match="streaming-text"):
        OpenText(bundle.prompt_builder, dataclasses.replace(spec, streaming_text=False)).push("Hello there ")
    open_ = OpenText(bundle.prompt_builder, spec, max_positions=12)
    assert open_.push("Hello there ") is not None
    with pytest.raises(InvalidArgument, match="too long"):
        open_.push("and a great many more words than twelve positions hold ")


def run(
    gen: EagerGenerator,
    rid: str,
    prompt,
    feed_plan: dict[int, list[tuple[str, bool]]] | None = None,
    open_: OpenText | None = None,
    max_steps: int = 400,
):
    """Step until `rid` ends; before step i push `feed_plan[i]` into `open_`. Returns the codes and
    the steps at which `rid` produced nothing without ending (it waited)."""
    gen.add(rid, prompt, GREEDY, max_new_frames=None)
    codes, waited = [], []
    for step in range(max_steps):
        for piece, final in (feed_plan or {}).get(step, []):
            open_.push(piece, final)
        outs = [o for o in gen.step() if o.request_id == rid]
        if not outs:
            waited.append(step)
            continue
        (o,) = outs
        if o.codes is not None:
            codes.append(o.codes)
        if o.finished:
            return torch.stack(codes), waited, o.finish_reason
    raise AssertionError("did not finish")


def whole_codes(bundle, spec, text):
    prompt = bundle.build_prompt(dataclasses.replace(spec, text=text))
    codes, waited, reason = run(EagerGenerator(bundle, max_batch=2), "whole", prompt)
    assert not waited
    return codes, reason


@pytest.mark.parametrize("mode", ["icl", "x_vector", "design"])
def test_text_in_pieces_before_it_is_needed_gives_the_whole_texts_codes(bundle64, mode):
    bundle, spec = specs(bundle64)[mode]
    text = TEXTS[0]
    want, reason = whole_codes(bundle, spec, text)
    open_ = OpenText(bundle.prompt_builder, spec)
    pieces = pieces_of(text, 4)
    prompt = None
    i = 0
    while prompt is None:
        prompt = open_.push(pieces[i])
        i += 1
    # Every later piece arrives one per step: faster than one token a frame is consumed.
    plan = {k: [(p, i + k == len(pieces) - 1)] for k, p in enumerate(pieces[i:])}
    got, waited, got_reason = run(EagerGenerator(bundle, max_batch=2), "pieces", prompt, plan, open_)
    assert not waited and got_reason == reason
    assert torch.equal(got, want)


def test_a_stream_whose_text_runs_dry_waits_then_continues_as_the_whole_text(bundle64):
    bundle, spec = specs(bundle64)["x_vector"]
    text = TEXTS[0]
    want, reason = whole_codes(bundle, spec, text)
    open_ = OpenText(bundle.prompt_builder, spec)
    prompt = open_.push("Hello there, this ")
    assert prompt is not None and not prompt.text_feed.closed
    known = prompt.text_feed.num_positions
    # The rest comes 30 steps later: far past the known text, so the stream waits meanwhile.
    plan = {30: [(text[len("Hello there, this ") :], True)]}
    gen = EagerGenerator(bundle, max_batch=2)
    got, waited, got_reason = run(gen, "dry", prompt, plan, open_)
    assert waited and min(waited) == known and max(waited) == 29  # stepped while it had text, not after
    assert got_reason == reason and torch.equal(got, want)  # no tts_pad fed while it waited


def test_an_open_stream_does_not_step_but_keeps_its_slot(bundle64):
    bundle, spec = specs(bundle64)["design"]
    open_ = OpenText(bundle.prompt_builder, spec)
    prompt = open_.push("Hello there, friend ")
    gen = EagerGenerator(bundle, max_batch=2)
    gen.add("a", prompt, GREEDY)
    n = prompt.text_feed.num_positions
    frames = sum(1 for _ in range(n) for o in gen.step() if o.codes is not None)
    assert frames == n
    for _ in range(5):
        assert gen.step() == []  # waiting: no frame, no end
    assert gen.num_active == 1 and "a" in gen.active
    open_.push("how are you? ")
    assert [o.request_id for o in gen.step()] == ["a"]
    assert gen.cancel("a") and gen.num_active == 0


def test_feed_ready_and_chunks():
    feed = TextFeed(2)
    assert feed.ready(1) and not feed.ready(2)
    feed.append(torch.zeros(0, 4))
    feed.append(torch.ones(3, 4))
    assert feed.ready(4) and not feed.ready(5) and feed.chunks_from(0)[0][0].shape == (3, 4)
    feed.close(torch.ones(1, 4), max_frames=9, default_max_frames=None, num_text_tokens=6)
    chunks, closed = feed.chunks_from(1)
    assert closed and len(chunks) == 1 and feed.ready(100)
    with pytest.raises(ValueError):
        feed.append(torch.ones(1, 4))
