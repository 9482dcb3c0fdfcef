"""GraphEngine (CPU path) with text appended while streams run: the codes equal the whole text's,
and a stream whose text ran dry sits the steps out (no tts_pad fed) until more arrives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qtts.engine import GraphEngine, GraphEngineConfig, RunnerConfig
from qtts.model import SamplingParams
from qtts.model.text_feed import TextFeed
from tests.qtts.engine.test_engine_cpu import same_outputs
from tests.qtts.engine.tiny_talker import make_prompt, run_alone

NEVER_STOP = SamplingParams(greedy=True, min_new_tokens=10**6)


def engine(bundle, **runner_kw) -> GraphEngine:
    cfg = RunnerConfig(**{"max_batch": 4, "max_len": 96, "max_trailing": 24, **runner_kw})
    return GraphEngine(bundle, config=GraphEngineConfig(runner=cfg, max_prefill_tokens=2048))


def open_version(prompt, known: int):
    """The prompt with only its first `known` trailing positions, the rest to come via a feed."""
    feed = TextFeed(known)
    return dataclasses.replace(prompt, trailing=prompt.trailing[:known], text_feed=feed), feed


def close(feed: TextFeed, prompt, start: int) -> None:
    feed.close(
        prompt.trailing[start:], max_frames=prompt.max_frames, default_max_frames=None, num_text_tokens=9
    )


@pytest.mark.parametrize(
    "runner_kw", [{}, {"pad_to_buckets": True, "batch_buckets": (2, 4)}], ids=["exact", "padded"]
)
def test_text_appended_in_time_gives_the_whole_texts_codes_beside_other_streams(tiny_bundle, runner_kw):
    whole = make_prompt(tiny_bundle, 14, 12, seed=7, max_frames=20)
    others = [make_prompt(tiny_bundle, 10 + i, 3, seed=20 + i) for i in range(2)]
    want = run_alone(tiny_bundle, whole, NEVER_STOP, None)
    want_others = [run_alone(tiny_bundle, p, NEVER_STOP, 3 + 2 * i) for i, p in enumerate(others)]
    assert want[-1].finish_reason == "frame_cap" and len(want) == 20

    eng = engine(tiny_bundle, **runner_kw)
    prompt, feed = open_version(whole, 2)
    # The other streams finish first, so the open stream moves to another slot while it runs.
    eng.add("o0", others[0], NEVER_STOP, 3)
    eng.add("o1", others[1], NEVER_STOP, 5)
    eng.add("open", prompt, NEVER_STOP, None)
    got: dict[str, list] = {}
    for step in range(40):
        if step < 5:
            feed.append(whole.trailing[2 + 2 * step : 4 + 2 * step])  # two positions a step
        elif step == 5:
            close(feed, whole, 12)
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
        if not eng.has_work:
            break
    assert same_outputs(got["open"], want)
    assert same_outputs(got["o0"], want_others[0]) and same_outputs(got["o1"], want_others[1])
    assert eng.num_active == 0 and not eng._open_text


def test_a_stream_without_text_waits_in_the_batch_then_continues(tiny_bundle):
    whole = make_prompt(tiny_bundle, 12, 10, seed=8, max_frames=18)
    other = make_prompt(tiny_bundle, 11, 2, seed=30)
    want = run_alone(tiny_bundle, whole, NEVER_STOP, None)
    want_other = run_alone(tiny_bundle, other, NEVER_STOP, 12)
    eng = engine(tiny_bundle)
    prompt, feed = open_version(whole, 3)
    eng.add("open", prompt, NEVER_STOP, None)
    eng.add("other", other, NEVER_STOP, 12)
    got: dict[str, list] = {}
    waited = []
    for step in range(60):
        if step == 10:
            feed.append(whole.trailing[3:6])
        elif step == 20:
            close(feed, whole, 6)
        outs = eng.step()
        if not any(o.request_id == "open" for o in outs):
            waited.append(step)
        for o in outs:
            got.setdefault(o.request_id, []).append(o)
        if not eng.has_work:
            break
    # Frames 0-2 have their text; then nothing until step 10, frames 3-5, nothing until step 20.
    assert waited[:7] == [3, 4, 5, 6, 7, 8, 9] and waited[7:10] == [13, 14, 15]
    assert eng.runner.slot_ints[:, 8].max().item() <= 10  # trailing length of the slot: never past the text
    assert same_outputs(got["open"], want)  # as if the text had been there: no tts_pad fed
    assert same_outputs(got["other"], want_other)  # the batch went on without it


def test_a_caller_bound_holds_while_the_text_is_open_and_cancel_forgets_the_feed(tiny_bundle):
    whole = make_prompt(tiny_bundle, 12, 10, seed=9, max_frames=18)
    eng = engine(tiny_bundle)
    prompt, feed = open_version(whole, 10)
    eng.add("bounded", prompt, NEVER_STOP, 4)
    outs = []
    while eng.has_work:
        outs += eng.step()
    assert outs[-1].finish_reason == "length" and sum(o.codes is not None for o in outs) == 4
    prompt2, _ = open_version(whole, 1)
    eng.add("gone", prompt2, NEVER_STOP, None)
    eng.step()
    eng.step()
    assert eng.cancel("gone") and not eng._open_text and eng.num_active == 0


def test_closing_applies_the_whole_texts_bounds(tiny_bundle):
    whole = make_prompt(tiny_bundle, 12, 4, seed=10, max_frames=7)
    eng = engine(tiny_bundle)
    prompt, feed = open_version(whole, 2)
    eng.add("capped", prompt, NEVER_STOP, None)
    outs = eng.step() + eng.step()
    close(feed, whole, 2)
    while eng.has_work:
        outs += eng.step()
    assert outs[-1].finish_reason == "frame_cap" and sum(o.codes is not None for o in outs) == 7
    assert same_outputs(outs, run_alone(tiny_bundle, whole, NEVER_STOP, None))


def test_trailing_buffer_copy_is_exact(tiny_bundle):
    eng = engine(tiny_bundle)
    whole = make_prompt(tiny_bundle, 10, 6, seed=11)
    prompt, feed = open_version(whole, 2)
    eng.add("x", prompt, NEVER_STOP, None)
    eng.step()
    feed.append(whole.trailing[2:5])
    eng.step()
    slot = eng.scheduler.get("x").slot
    assert torch.equal(eng.runner.trailing[slot, :5], whole.trailing[:5].to(eng.runner.dtype))
    assert torch.equal(eng.runner.trailing[slot, 5], whole.pad_embed.to(eng.runner.dtype))
