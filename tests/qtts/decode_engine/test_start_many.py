"""SlotDecoder.start_many: several new streams in one pass equal `start` per stream; misses of equal
length share eager windows; a stream's error stays with it (its slot freed)."""

from __future__ import annotations

import pytest
import torch

from qtts.decode_engine import SlotDecoder, SlotDecoderConfig, SlotPoolFull, SlotState
from qtts.decode_engine.runner import conv_stack_receptive_frames
from qtts.model.codec_decoder import CodecDecoder

SPF = 1920
ATOL = 1e-4  # as test_slot_decoder: a batch of rows may differ from one row in the last bits


@pytest.fixture(scope="module")
def decoder(tiny_codec_decoder) -> CodecDecoder:
    return tiny_codec_decoder


def _codes(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (t, 16), generator=torch.Generator().manual_seed(seed))


def _engine(decoder: CodecDecoder, **kw) -> SlotDecoder:
    cfg = SlotDecoderConfig(
        max_streams=kw.pop("max_streams", 8),
        precision="fp32",
        emulate_graphs=True,
        batch_sizes=(1, 2, 4, 8),
        chunk_sizes=(1, 2, 4, 8, 25),
        **kw,
    )
    engine = SlotDecoder(decoder, cfg)
    engine.capture()
    return engine


def _frame_calls(engine: SlotDecoder, monkeypatch) -> list[int]:
    """Rows of each eager frame-rate call (the prefix heads), recorded."""
    calls: list[int] = []
    real = engine.runner.run_eager

    def run_eager(slots, positions, codes, frame_only=False):
        if frame_only:
            calls.append(len(slots))
        return real(slots, positions, codes, frame_only=frame_only)

    monkeypatch.setattr(engine.runner, "run_eager", run_eager)
    return calls


def _continue(
    engine: SlotDecoder, states: list[SlotState], streams: list[torch.Tensor]
) -> list[torch.Tensor]:
    out: list[list[torch.Tensor]] = [[] for _ in states]
    for off, n in ((0, 2), (2, 4), (6, 8), (14, 16)):
        for i, wav in enumerate(engine.decode_batch(states, [s[off : off + n] for s in streams])):
            out[i].append(wav)
    return [torch.cat(o) for o in out]


def test_start_many_equals_start_per_stream(decoder, monkeypatch):
    tail = conv_stack_receptive_frames(decoder)
    assert tail < 30  # the 30- and 100-frame prefixes have heads; 5 frames is all tail
    p30 = [_codes(30, seed=s) for s in (1, 2, 3)]
    prefixes = [p30[0], p30[1], None, _codes(5, seed=4), p30[0], _codes(100, seed=5), p30[2]]
    many, one = _engine(decoder), _engine(decoder)
    heads = _frame_calls(many, monkeypatch)
    got = many.start_many(prefixes)
    want = [one.start(p) for p in prefixes]
    assert all(isinstance(s, SlotState) for s in got)
    # The three distinct 30-frame misses share one window; the 100-frame one takes two.
    assert heads == [3, 1, 1]
    assert (many.prefix_hits, many.prefix_misses) == (one.prefix_hits, one.prefix_misses) == (1, 5)
    for g, w in zip(got, want, strict=True):
        assert (g.frames, g.prefix_frames, g.output_frames) == (w.frames, w.prefix_frames, 0)
    assert len({s.slot for s in got}) == len(got)
    streams = [_codes(30, seed=20 + i) for i in range(len(prefixes))]
    streams[4] = streams[0]  # the repeated prefix, continued the same way
    outs, refs = _continue(many, got, streams), _continue(one, want, streams)
    for p, s, o, r in zip(prefixes, streams, outs, refs, strict=True):
        torch.testing.assert_close(o, r, atol=ATOL, rtol=0)
        full = decoder.decode(s if p is None else torch.cat([p, s]))
        p_len = 0 if p is None else p.shape[0]
        torch.testing.assert_close(o, full[p_len * SPF :], atol=ATOL, rtol=0)
    # The repeated prefix copied the state decoded in the same call: exactly the same audio.
    assert torch.equal(outs[4], outs[0])


def test_errors_stay_with_their_stream(decoder, monkeypatch):
    engine = _engine(decoder, max_streams=4)
    bad = torch.zeros(4, 3, dtype=torch.long)
    got = engine.start_many([_codes(30, seed=1), bad, None, _codes(6, seed=2), None, _codes(8, seed=3)])
    assert isinstance(got[1], ValueError) and "codes must be" in str(got[1])  # took no slot
    assert isinstance(got[5], SlotPoolFull)  # the sixth stream found the four slots taken
    assert [isinstance(s, SlotState) for s in got] == [True, False, True, True, True, False]
    assert engine.num_live == 4 and engine.pool.num_free == 0
    engine.free_all()

    # A failing eager window fails its prefix-length group (and a copy of its prefix) only.
    real = engine.runner.run_eager

    def run_eager(slots, positions, codes, frame_only=False):
        if frame_only and codes[0].shape[0] == 40 - conv_stack_receptive_frames(decoder):
            raise RuntimeError("device error")
        return real(slots, positions, codes, frame_only=frame_only)

    monkeypatch.setattr(engine.runner, "run_eager", run_eager)
    p40, p30 = _codes(40, seed=3), _codes(30, seed=4)
    got = engine.start_many([p40, p30, p40, None])
    assert isinstance(got[0], RuntimeError) and got[2] is got[0]
    assert isinstance(got[1], SlotState) and isinstance(got[3], SlotState)
    assert engine.num_live == 2 and engine.pool.num_free == 2
    stream = _codes(30, seed=5)
    out = _continue(engine, [got[1]], [stream])[0]
    torch.testing.assert_close(out, decoder.decode(torch.cat([p30, stream]))[30 * SPF :], atol=ATOL, rtol=0)
    monkeypatch.undo()
    engine.free_all()

    # A failing tail decode fails the streams decoded in it; a cache hit in the same call lives.
    def boom(*args, **kwargs):
        raise RuntimeError("step failed")

    monkeypatch.setattr(engine, "_decode", boom)
    got = engine.start_many([p30, _codes(20, seed=6), None])
    assert isinstance(got[0], SlotState) and got[0].prefix_frames == 30  # p30 was cached above
    assert isinstance(got[1], RuntimeError) and isinstance(got[2], SlotState)
    assert engine.num_live == 2
    with pytest.raises(RuntimeError, match="step failed"):
        engine.start(_codes(20, seed=6))
    assert engine.num_live == 2 and engine.pool.num_free == 2


def test_an_interrupt_frees_every_state_of_the_call(decoder, monkeypatch):
    engine = _engine(decoder, max_streams=4)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.start_many([None, _codes(20, seed=1)])
    assert engine.num_live == 0 and engine.pool.num_free == 4
