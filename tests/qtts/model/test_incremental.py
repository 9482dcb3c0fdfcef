"""Stateful incremental decoding equals one full decode, for every chunking and in mixed batches."""

from __future__ import annotations

import random

import pytest
import torch

from qtts.model.codec_decoder import CodecDecoder
from qtts.model.incremental import DecoderState, IncrementalDecoder

SPF = 1920
ATOL = 1e-4


@pytest.fixture(scope="module")
def decoder(tiny_codec_decoder) -> CodecDecoder:
    return tiny_codec_decoder


def _codes(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (t, 16), generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _check_every_composition(inc: IncrementalDecoder, state: DecoderState, codes, reference, start=0) -> int:
    """Walk the tree of all compositions of codes[start:] into chunks; every edge's output must be
    the reference slice. Each composition is a root-to-leaf path, so this checks them all. The
    edges leaving one node run as one batch of forks of that node's state (rows of unequal length)."""
    n = codes.shape[0]
    ends = list(range(start + 1, n + 1))
    forks = [inc.fork(state) for _ in ends]
    outs = inc.decode_batch(forks, [codes[start:end] for end in ends])
    checked = 0
    for end, fork, out in zip(ends, forks, outs, strict=True):
        _close(out, reference[start * SPF : end * SPF])
        checked += 1
        if end < n:
            checked += _check_every_composition(inc, fork, codes, reference, end)
        inc.free(fork)
    return checked


@pytest.mark.parametrize("prefix_frames,frames", [(0, 8), (5, 7)])
def test_every_partition_matches_full_decode(decoder, prefix_frames, frames):
    inc = IncrementalDecoder(decoder)
    prefix = _codes(prefix_frames, seed=1)
    codes = _codes(frames, seed=2)
    reference = decoder.decode(torch.cat([prefix, codes]))[prefix_frames * SPF :]
    state = inc.start(prefix if prefix_frames else None)
    edges = _check_every_composition(inc, state, codes, reference)
    assert edges == sum(2 ** max(i - 1, 0) * (frames - i) for i in range(frames))


@pytest.mark.parametrize("prefix_frames", [0, 30])
def test_random_partitions_across_the_attention_window(decoder, prefix_frames):
    inc = IncrementalDecoder(decoder)
    rng = random.Random(prefix_frames)
    prefix = _codes(prefix_frames, seed=3)
    codes = _codes(90, seed=4)
    reference = decoder.decode(torch.cat([prefix, codes]))[prefix_frames * SPF :]
    partitions = [[1] * 6 + [84], [4, 4, 8, 16, 25, 25, 8]]
    for _ in range(2):
        cuts = sorted(rng.sample(range(1, 90), 7))
        partitions.append([b - a for a, b in zip([0, *cuts], [*cuts, 90], strict=True)])
    for sizes in partitions:
        state = inc.start(prefix if prefix_frames else None)
        outs, i = [], 0
        for n in sizes:
            outs.append(inc.decode(state, codes[i : i + n]))
            i += n
        _close(torch.cat(outs), reference)
        assert state.frames == prefix_frames + 90 and state.output_frames == 90


def test_prefix_samples_are_cut_exactly(decoder):
    inc = IncrementalDecoder(decoder)
    prefix, codes = _codes(12, seed=5), _codes(3, seed=6)
    state = inc.start(prefix)
    assert (state.frames, state.prefix_frames, state.output_frames) == (12, 12, 0)
    out = inc.decode(state, codes)
    assert out.shape == (3 * SPF,)
    full = decoder.decode(torch.cat([prefix, codes]))
    _close(out, full[12 * SPF :])
    # One sample off in either direction would not match.
    assert (out[1:] - full[12 * SPF : -1]).abs().max() > 1e-2
    assert (out[:-1] - full[12 * SPF + 1 :]).abs().max() > 1e-2


def test_batch_with_skipped_rows_gives_each_stream_its_own_output(decoder):
    """A skipped (empty) earlier row must not shift any later row's trim or state."""
    inc = IncrementalDecoder(decoder)
    prefixes = [_codes(7, seed=10), None, _codes(20, seed=11), None]
    streams = [_codes(30, seed=20 + i) for i in range(4)]
    # Chunk plan per step: row 0 is empty on the first step (a stream waiting for frames).
    plan = [[0, 3, 1, 5], [4, 0, 6, 2], [2, 5, 0, 0], [9, 1, 4, 8]]
    solo_states = [inc.start(p) for p in prefixes]
    batch_states = [inc.start(p) for p in prefixes]
    offsets = [0, 0, 0, 0]
    for step in plan:
        chunks = [s[o : o + n] for s, o, n in zip(streams, offsets, step, strict=True)]
        batched = inc.decode_batch(batch_states, chunks)
        for row, chunk in enumerate(chunks):
            solo = inc.decode(solo_states[row], chunk)
            assert batched[row].shape == (chunk.shape[0] * SPF,)
            _close(batched[row], solo)
        offsets = [o + n for o, n in zip(offsets, step, strict=True)]
    for row, (p, s) in enumerate(zip(prefixes, streams, strict=True)):
        assert batch_states[row].frames == (0 if p is None else p.shape[0]) + offsets[row]
        # The concatenated batched outputs also equal the full decode (states restored to the right row).
        ref_state = inc.start(p)
        want = inc.decode(ref_state, s[: offsets[row]])
        got_state = inc.start(p)
        got = torch.cat(inc.decode_batch([inc.start(), got_state], [s[:0], s[: offsets[row]]]))
        _close(got, want)


def test_reference_audio_does_not_leak_into_the_output(decoder):
    # Long clips: the correlation of two unrelated random-weight waveforms shrinks with length.
    inc = IncrementalDecoder(decoder)
    ref_codes = _codes(300, seed=30)
    reference_audio = decoder.decode(ref_codes)
    new_codes = _codes(300, seed=31)
    state = inc.start(ref_codes)
    out = torch.cat([inc.decode(state, new_codes[i : i + 25]) for i in range(0, 300, 25)])
    window = reference_audio.shape[0]

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([a[:window].double(), b[:window].double()]))[0, 1].item()

    assert abs(corr(out, reference_audio)) < 0.05
    # The probe itself sees a leak: output that still starts with the reference correlates fully.
    uncut = torch.cat([reference_audio, out])
    assert corr(uncut, reference_audio) > 0.9


def test_errors(decoder):
    inc = IncrementalDecoder(decoder)
    state = inc.start()
    with pytest.raises(ValueError, match="codes must be"):
        inc.decode(state, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="twice"):
        inc.decode_batch([state, state], [_codes(1, 0), _codes(1, 1)])
    with pytest.raises(ValueError, match="states but"):
        inc.decode_batch([state], [])
    assert inc.decode(state, _codes(0, 0)).shape == (0,)
    assert state.frames == 0 and inc.state_nbytes > 0 and inc.num_active == 1
    inc.free(state)
    inc.free(state)
    assert inc.num_active == 0
    with pytest.raises(ValueError, match="freed"):
        inc.decode(state, _codes(1, 0))


def test_slots_grow_and_are_reused_with_clean_history(decoder):
    inc = IncrementalDecoder(decoder, initial_slots=2)
    codes = _codes(4, seed=40)
    want = decoder.decode(codes)
    used = [inc.start(_codes(3, seed=41)) for _ in range(5)]  # grows past the initial 2 slots
    assert inc.capacity >= 5 and inc.num_active == 5
    for s in used:
        inc.decode(s, _codes(2, seed=42))
    for s in used[:3]:
        inc.free(s)
    fresh = inc.start()
    assert fresh.slot in {s.slot for s in used[:3]}
    _close(inc.decode(fresh, codes), want)
    # The streams still running were not disturbed by the reuse.
    ref = IncrementalDecoder(decoder)
    alone = ref.start(_codes(3, seed=41))
    ref.decode(alone, _codes(2, seed=42))
    _close(inc.decode(used[4], codes), ref.decode(alone, codes))
