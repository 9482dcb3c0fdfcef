"""SlotDecoder: chunked streams decoded in mixed, padded batches equal one full decode per stream;
state lifetime (bound, free, stale handles, failures); bf16 fast path SNR against fp32."""

from __future__ import annotations

import pytest
import torch

from qtts.decode_engine import SlotDecoder, SlotDecoderConfig, SlotPoolFull, load_slot_decoder
from qtts.decode_engine.batcher import WorkItem
from qtts.decode_engine.runner import conv_stack_receptive_frames, precision_flags
from qtts.model.codec_decoder import CodecDecoder
from qtts.tiny_model.codec import write_tiny_speech_tokenizer

SPF = 1920
ATOL = 1e-4
# bf16 on the tiny random decoder measures about 40 dB against fp32; 30 dB leaves room for
# platform differences while still failing on any real bug (a wrong row or state gives < 5 dB).
BF16_MIN_SNR_DB = 30.0


@pytest.fixture(scope="module")
def decoder(tiny_codec_decoder) -> CodecDecoder:
    return tiny_codec_decoder


def test_package_reexports_the_slot_decoder_module():
    from qtts.decode_engine import slot_decoder

    assert SlotDecoder is slot_decoder.SlotDecoder and SlotDecoderConfig is slot_decoder.SlotDecoderConfig
    assert load_slot_decoder is slot_decoder.load_slot_decoder


def _codes(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (t, 16), generator=torch.Generator().manual_seed(seed))


def _engine(decoder: CodecDecoder, static: bool, **kw) -> SlotDecoder:
    cfg = SlotDecoderConfig(
        max_streams=kw.pop("max_streams", 8),
        precision=kw.pop("precision", "fp32"),
        emulate_graphs=static,
        batch_sizes=(1, 2, 4, 8),
        chunk_sizes=(1, 2, 4, 8, 25),
        **kw,
    )
    engine = SlotDecoder(decoder, cfg)
    engine.capture()
    return engine


def _snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    noise = (ref.double() - x.double()).pow(2).sum()
    return 10.0 * torch.log10(ref.double().pow(2).sum() / noise).item()


# Per step, the frames each stream gets (0 = the stream is waiting this step). Stream 0 is empty in
# the first step, so every later row sits behind a skipped one; the sizes include uncaptured ones
# (3, 5, 7, 30, 44: split or eager) and every stream passes the 72-frame attention window.
SCHEDULE = [
    [0, 2, 1, 4, 2],
    [3, 4, 1, 0, 4],
    [5, 4, 2, 8, 0],
    [25, 8, 30, 16, 7],
    [25, 0, 44, 25, 25],
    [25, 16, 1, 25, 25],
    [9, 25, 1, 2, 25],
    [0, 25, 2, 0, 8],
]
PREFIXES = [None, 30, None, 5, 100]  # None, longer than the conv receptive field, shorter, > window


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-buffers"])
def test_streams_in_mixed_batches_equal_one_full_decode(decoder, static):
    engine = _engine(decoder, static)
    assert conv_stack_receptive_frames(decoder) < 30  # prefix 30 and 100 take the trimmed path
    totals = [sum(step[i] for step in SCHEDULE) for i in range(len(PREFIXES))]
    assert min(totals) > 72
    prefixes = [None if p is None else _codes(p, seed=50 + i) for i, p in enumerate(PREFIXES)]
    streams = [_codes(t, seed=60 + i) for i, t in enumerate(totals)]
    states = [engine.start(p) for p in prefixes]
    outputs: list[list[torch.Tensor]] = [[] for _ in states]
    offsets = [0] * len(states)
    for step in SCHEDULE:
        chunks = [s[o : o + n] for s, o, n in zip(streams, offsets, step, strict=True)]
        runs_before = engine.steps_total
        planned = len(
            engine.planner.plan(
                [WorkItem(st.id, n, first=st.output_frames == 0) for st, n in zip(states, step, strict=True)]
            )
        )
        got = engine.decode_batch(states, chunks)
        assert engine.steps_total - runs_before == planned  # one decoder run per planned step (metrics)
        for i, (g, n) in enumerate(zip(got, step, strict=True)):
            assert g.shape == (n * SPF,) and g.dtype == torch.float32
            outputs[i].append(g)
            offsets[i] += n
    for i, (p, s) in enumerate(zip(prefixes, streams, strict=True)):
        p_len = 0 if p is None else p.shape[0]
        full = decoder.decode(s if p is None else torch.cat([p, s]))
        want = full[p_len * SPF :]
        got = torch.cat(outputs[i])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert states[i].frames == p_len + totals[i] and states[i].output_frames == totals[i]
    # The reference is not trivially matched: neighbouring streams differ by far more than ATOL.
    assert (torch.cat(outputs[0])[: 72 * SPF] - torch.cat(outputs[2])[: 72 * SPF]).abs().max() > 0.01


def test_one_frame_chunks_and_single_decode_match(decoder):
    engine = _engine(decoder, static=True)
    codes = _codes(12, seed=5)
    state = engine.start()
    got = torch.cat([engine.decode(state, codes[i : i + 1]) for i in range(12)])
    torch.testing.assert_close(got, decoder.decode(codes), atol=ATOL, rtol=0)
    assert engine.decode(state, codes[:0]).shape == (0,)
    assert state.frames == 12


def test_prefix_audio_is_cut_and_does_not_leak(decoder):
    engine = _engine(decoder, static=False)
    ref_codes, new_codes = _codes(25, seed=30), _codes(25, seed=31)
    reference_audio = decoder.decode(ref_codes)
    state = engine.start(ref_codes)
    assert (state.frames, state.prefix_frames, state.output_frames) == (25, 25, 0)
    out = torch.cat([engine.decode(state, new_codes[i : i + 5]) for i in range(0, 25, 5)])

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1].item()

    # Random-weight outputs share some structure (|corr| ~0.05); a leak correlates > 0.9.
    assert abs(corr(out, reference_audio)) < 0.2
    leaky = decoder.decode(torch.cat([ref_codes, new_codes]))[: out.shape[0]]
    assert corr(leaky, reference_audio) > 0.9  # the probe can see a leak


def test_state_bound_free_reuse_and_stale_handles(decoder):
    engine = _engine(decoder, static=True, max_streams=2)
    a, b = engine.start(), engine.start()
    assert engine.num_live == 2 and engine.pool.num_free == 0
    with pytest.raises(SlotPoolFull, match="in use"):
        engine.start()
    engine.decode(a, _codes(3, seed=1))
    engine.free(a)
    engine.free(a)  # idempotent
    assert engine.num_live == 1
    c = engine.start()
    assert c.slot == a.slot and c.id not in (a.id, b.id)  # the slot is reused, the id never
    assert c.frames == 0
    with pytest.raises(ValueError, match="freed"):
        engine.decode(a, _codes(1, seed=2))
    # The reused slot starts from zero history: c decodes like a fresh stream.
    codes = _codes(6, seed=3)
    torch.testing.assert_close(engine.decode(c, codes), decoder.decode(codes), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="twice"):
        engine.decode_batch([b, b], [_codes(1, 0), _codes(1, 1)])
    with pytest.raises(ValueError, match="codes must be"):
        engine.decode(b, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="states but"):
        engine.decode_batch([b], [])
    d = engine.reset(c)
    assert c.freed and not d.freed and d.frames == 0
    assert engine.free_all() == 2 and engine.num_live == 0 and engine.pool.num_free == 2


def test_a_failed_start_or_decode_does_not_leak_or_reuse_state(decoder, monkeypatch):
    engine = _engine(decoder, static=False, max_streams=2)
    with pytest.raises(ValueError, match="codes must be"):
        engine.start(torch.zeros(4, 3, dtype=torch.long))
    assert engine.pool.num_free == 2

    def boom(*args, **kwargs):
        raise RuntimeError("device error")

    a, b = engine.start(), engine.start()
    monkeypatch.setattr(engine.runner, "run_eager", boom)
    with pytest.raises(RuntimeError, match="device error"):
        engine.decode_batch([a, b], [_codes(2, 0), _codes(0, 1)])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unusable"):
        engine.decode(a, _codes(1, 0))
    engine.free(a)
    engine.free(b)
    assert engine.pool.num_free == 2 and engine.num_live == 0


def test_bf16_fast_path_snr_against_fp32(decoder):
    fp32 = _engine(decoder, static=True)
    bf16 = _engine(decoder, static=True, precision="bf16")
    assert bf16.pool.buffers[next(iter(bf16.pool.buffers))].dtype == torch.bfloat16
    assert decoder.dtype == torch.float32  # the reference weights are untouched
    plan = [2, 4, 4, 8, 16, 25, 25, 6]
    refs, fast = [], []
    for seed, prefix in ((1, None), (2, _codes(20, seed=9))):
        codes = _codes(sum(plan), seed=seed)
        for eng, dst in ((fp32, refs), (bf16, fast)):
            state = eng.start(prefix)
            off = 0
            for n in plan:
                dst.append(eng.decode(state, codes[off : off + n]))
                off += n
    ref, got = torch.cat(refs), torch.cat(fast)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    snr = _snr_db(ref, got)
    assert snr >= BF16_MIN_SNR_DB, f"bf16 SNR {snr:.1f} dB"
    assert snr < 100  # it really ran in bf16


def test_load_slot_decoder_from_a_snapshot_folder(decoder, tmp_path):
    write_tiny_speech_tokenizer(tmp_path, seed=0)
    engine = load_slot_decoder(str(tmp_path), device="cpu", config=SlotDecoderConfig(max_streams=2))
    assert engine.pool.capacity == 2 and engine.runner.precision == "tf32"
    codes = _codes(5, seed=8)
    state = engine.start()
    torch.testing.assert_close(engine.decode(state, codes), decoder.decode(codes), atol=ATOL, rtol=0)


def test_config_validation():
    with pytest.raises(ValueError, match="precision"):
        SlotDecoderConfig(precision="fp8")
    with pytest.raises(ValueError, match="max_streams"):
        SlotDecoderConfig(max_streams=0)
    with pytest.raises(ValueError):
        SlotDecoderConfig(batch_sizes=(1, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("conv_stack", ["channels_first", "channels_last", "channels_last_fused"])
def test_cuda_graphs_match_the_full_decode(decoder, precision, conv_stack):
    dec = decoder.to("cuda")
    try:
        engine = SlotDecoder(
            dec,
            SlotDecoderConfig(
                max_streams=4,
                precision=precision,
                batch_sizes=(1, 2, 4),
                chunk_sizes=(1, 2, 4, 25),
                conv_stack=conv_stack,
            ),
        )
        assert engine.capture() > 0 and engine.runner.has_graph(4, 25)
        prefixes = [None, _codes(30, seed=1), None]
        streams = [_codes(80, seed=10 + i) for i in range(3)]
        states = [engine.start(None if p is None else p.cuda()) for p in prefixes]
        outs: list[list[torch.Tensor]] = [[], [], []]
        off = 0
        for n in (2, 4, 4, 8, 16, 25, 21):
            # Host codes (one packed copy) for most steps, device codes for one.
            chunks = [s[off : off + n] for s in streams]
            if n == 8:
                chunks = [c.cuda() for c in chunks]
            for i, wav in enumerate(engine.decode_batch(states, chunks)):
                outs[i].append(wav.cpu())
            off += n
        for p, s, o in zip(prefixes, streams, outs, strict=True):
            p_len = 0 if p is None else p.shape[0]
            with precision_flags("fp32", dec.device):  # cuDNN convs default to TF32 on CUDA
                full = dec.decode((s if p is None else torch.cat([p, s])).cuda()).cpu()[p_len * SPF :]
            got = torch.cat(o)
            if precision == "fp32":
                torch.testing.assert_close(got, full, atol=ATOL, rtol=0)
            else:
                assert _snr_db(full, got) > BF16_MIN_SNR_DB
    finally:
        decoder.to("cpu")


def test_prefix_state_cache_gives_the_decoded_state_bit_for_bit(decoder):
    """A second stream of the same reference prefix copies the cached state instead of decoding
    the prefix: its audio equals the first stream's and an uncached engine's exactly, in another
    slot, while the first is still live; a different prefix misses; the LRU keeps `entries`."""
    cached = _engine(decoder, static=True, prefix_cache_entries=2)
    plain = _engine(decoder, static=True, prefix_cache_entries=0)
    ref, ref2, ref3 = _codes(30, seed=60), _codes(20, seed=61), _codes(20, seed=62)
    new = _codes(12, seed=63)

    def run(engine: SlotDecoder, prefix: torch.Tensor):
        state = engine.start(prefix)
        return state, torch.cat([engine.decode(state, new[i : i + 4]) for i in range(0, 12, 4)])

    want_state, want = run(plain, ref)
    first_state, first = run(cached, ref)
    assert (cached.prefix_hits, cached.prefix_misses) == (0, 1)
    second_state, second = run(cached, ref)
    assert (cached.prefix_hits, cached.prefix_misses) == (1, 1)
    assert second_state.slot != first_state.slot  # both live: the copy went to another slot
    assert (second_state.frames, second_state.prefix_frames) == (30 + 12, 30) == (want_state.frames, 30)
    assert torch.equal(first, want) and torch.equal(second, want)
    # Different prefixes miss; with 2 entries the least recently used one is evicted.
    run(cached, ref2)
    run(cached, ref3)
    assert (cached.prefix_hits, cached.prefix_misses) == (1, 3)
    run(cached, ref3)
    run(cached, ref)  # evicted by ref2 and ref3: decoded again
    assert (cached.prefix_hits, cached.prefix_misses) == (2, 4)
    with pytest.raises(ValueError, match="prefix_cache_entries"):
        SlotDecoderConfig(prefix_cache_entries=-1)
