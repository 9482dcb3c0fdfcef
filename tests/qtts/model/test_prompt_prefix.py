"""The prompt's reusable prefix: `prefix_len` positions that depend on the voice only, `prefix_key`."""

from __future__ import annotations

import pytest
import torch

from qtts.model import SynthesisSpec, VoicePrompt
from qtts.model.prompt import MIN_CACHED_PREFIX, assistant_text, ref_text_block
from qtts.model.tokenizer import encode

# Different first tokens, so the first target position differs between the two prompts.
TEXT_A = "Hello world, this is the first target text."
TEXT_B = "Completely different words follow here, and more of them."
REF_TEXT = "This is what the reference clip says, more or less."


def voice(bundle, seed: int, frames: int = 40, x_vector_only: bool = False) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    h = bundle.config.talker.decoder.hidden_size
    return VoicePrompt(
        x_vector=torch.randn(h, generator=g),
        ref_codes=None if x_vector_only else torch.randint(0, 2048, (frames, 16), generator=g),
        ref_text=None if x_vector_only else REF_TEXT,
        x_vector_only=x_vector_only,
    )


def clone(bundle, text: str, vp: VoicePrompt, language: str = "english", streaming: bool | None = None):
    spec = SynthesisSpec(
        text=text, task="voice_clone", language=language, voice_prompt=vp, streaming_text=streaming
    )
    return bundle.build_prompt(spec)


def assert_split_at_prefix(a, b) -> None:
    """Same leading `prefix_len` embeddings, different at `prefix_len` (the first target token)."""
    n = a.prefix_len
    assert n == b.prefix_len and 0 < n < min(a.embeds.shape[0], b.embeds.shape[0])
    assert torch.equal(a.embeds[:n], b.embeds[:n])
    assert not torch.allclose(a.embeds[n], b.embeds[n])


def head_len(bundle, with_language: bool, with_speaker: bool) -> int:
    """Role (3 text tokens) + codec prefix [think.., (lang), think_eos, (speaker), pad]."""
    return 3 + (4 if with_language else 3) + int(with_speaker) + 1


@pytest.mark.parametrize("streaming", [None, False], ids=["streaming", "non-streaming"])
def test_icl_prefix_ends_where_the_first_target_token_enters(bundle_factory, streaming):
    bundle = bundle_factory("base")
    vp = voice(bundle, seed=1)
    a, b = clone(bundle, TEXT_A, vp, streaming=streaming), clone(bundle, TEXT_B, vp, streaming=streaming)
    ref_ids = encode(bundle.tokenizer, ref_text_block(REF_TEXT))[3:-2]
    assert a.prefix_len == head_len(bundle, True, True) + len(ref_ids)
    assert_split_at_prefix(a, b)
    assert a.prefix_key is not None and a.prefix_key == b.prefix_key
    assert a.prefix_len >= MIN_CACHED_PREFIX
    # Position prefix_len is the first target token on the text track.
    t = bundle.talker
    with torch.no_grad():
        first_a = t.embed_text(torch.tensor([[encode(bundle.tokenizer, "Hello")[0]]]))[0, 0]
        first_b = t.embed_text(torch.tensor([[encode(bundle.tokenizer, "Completely")[0]]]))[0, 0]
    torch.testing.assert_close(
        a.embeds[a.prefix_len] - b.embeds[b.prefix_len], first_a - first_b, atol=1e-5, rtol=0
    )


def test_icl_prefix_key_follows_every_voice_side_input(bundle_factory):
    bundle = bundle_factory("base")
    vp = voice(bundle, seed=1)
    base = clone(bundle, TEXT_A, vp).prefix_key
    assert clone(bundle, TEXT_B, voice(bundle, seed=1)).prefix_key == base  # same voice, rebuilt
    other_codes = VoicePrompt(vp.x_vector, vp.ref_codes.clone(), vp.ref_text, False)
    other_codes.ref_codes[0, 3] = (other_codes.ref_codes[0, 3] + 1) % 2048
    other_xvec = VoicePrompt(vp.x_vector + 1e-3, vp.ref_codes, vp.ref_text, False)
    other_ref = VoicePrompt(vp.x_vector, vp.ref_codes, REF_TEXT + " Yes.", False)
    keys = {
        clone(bundle, TEXT_A, other_codes).prefix_key,
        clone(bundle, TEXT_A, other_xvec).prefix_key,
        clone(bundle, TEXT_A, other_ref).prefix_key,
        clone(bundle, TEXT_A, vp, language="german").prefix_key,
        clone(bundle, TEXT_A, vp, language="auto").prefix_key,
        clone(bundle, TEXT_A, vp, streaming=False).prefix_key,
    }
    assert None not in keys and base not in keys and len(keys) == 6


def test_icl_reference_text_longer_than_the_body_makes_the_whole_prompt_the_prefix(bundle_factory):
    bundle = bundle_factory("base")
    vp = voice(bundle, seed=2, frames=3)  # 4 body positions, far fewer than the reference tokens
    a, b = clone(bundle, TEXT_A, vp), clone(bundle, TEXT_B, vp)
    assert a.prefix_len == a.embeds.shape[0] == b.embeds.shape[0]
    assert torch.equal(a.embeds, b.embeds) and a.prefix_key == b.prefix_key
    assert not torch.equal(a.trailing[: b.trailing.shape[0]], b.trailing[: a.trailing.shape[0]])


def test_x_vector_only_prefix_is_exact_but_too_short_to_cache(bundle_factory):
    bundle = bundle_factory("base")
    vp = voice(bundle, seed=3, x_vector_only=True)
    a, b = clone(bundle, TEXT_A, vp), clone(bundle, TEXT_B, vp)
    assert a.prefix_len == head_len(bundle, True, True) < MIN_CACHED_PREFIX
    assert_split_at_prefix(a, b)
    assert a.prefix_key is None and b.prefix_key is None


INSTRUCT = "Speak slowly and warmly, like a storyteller reading a long bedtime story to a child."


@pytest.mark.parametrize("streaming", [None, True])
def test_instruct_prefix_for_custom_voice_and_voice_design(bundle_factory, streaming):
    cv = bundle_factory("custom_voice")
    kw = dict(
        task="custom_voice", speaker="ryan", language="english", instruct=INSTRUCT, streaming_text=streaming
    )
    a = cv.build_prompt(SynthesisSpec(text=TEXT_A, **kw))
    b = cv.build_prompt(SynthesisSpec(text=TEXT_B, **kw))
    n_instruct = len(encode(cv.tokenizer, f"<|im_start|>user\n{INSTRUCT}<|im_end|>\n"))
    assert a.prefix_len == n_instruct + head_len(cv, True, True)
    assert_split_at_prefix(a, b)
    assert a.prefix_key is not None and a.prefix_key == b.prefix_key
    other = cv.build_prompt(SynthesisSpec(text=TEXT_A, **{**kw, "speaker": "vivian"}))
    assert other.prefix_key != a.prefix_key
    no_instruct = cv.build_prompt(SynthesisSpec(text=TEXT_A, **{**kw, "instruct": None}))
    assert no_instruct.prefix_len == head_len(cv, True, True) and no_instruct.prefix_key is None

    vd = bundle_factory("voice_design")
    kw = dict(task="voice_design", language="auto", instruct=INSTRUCT, streaming_text=streaming)
    c = vd.build_prompt(SynthesisSpec(text=TEXT_A, **kw))
    d = vd.build_prompt(SynthesisSpec(text=TEXT_B, **kw))
    assert c.prefix_len == n_instruct + head_len(vd, False, False)
    assert_split_at_prefix(c, d)
    assert c.prefix_key is not None and c.prefix_key == d.prefix_key
    assert (
        vd.build_prompt(SynthesisSpec(text=TEXT_A, **{**kw, "instruct": INSTRUCT + "!"})).prefix_key
        != c.prefix_key
    )


def test_text_that_merges_into_the_role_token_gets_its_own_key(bundle_factory):
    bundle = bundle_factory("base")
    vp = voice(bundle, seed=1)
    a, b = clone(bundle, "\nHello there.", vp), clone(bundle, "\nGoodbye now.", vp)
    assert_split_at_prefix(a, b)
    assert a.prefix_key == b.prefix_key
    # A leading newline merges with the role's "\n" into one token: the role ids differ, so the
    # cached KV of plain texts must not be reused for it.
    tok = bundle.tokenizer
    assert encode(tok, assistant_text("\nHello"))[:3] != encode(tok, assistant_text("Hello"))[:3]
    assert clone(bundle, "Hello there.", vp).prefix_key != a.prefix_key
