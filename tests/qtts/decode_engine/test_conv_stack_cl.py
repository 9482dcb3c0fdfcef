"""The channels-last conv stacks (`conv_stack="channels_last"` and `"channels_last_fused"`) against
the reference path: fp32
outputs equal the full decode and the channels-first step for every partition of the frames into
chunks (1-frame chunks included), late joins at every batch bucket, and its Triton SnakeBeta passes
(run by Triton's interpreter here) equal their torch versions."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from qtts.decode_engine import SlotDecoder, SlotDecoderConfig
from qtts.decode_engine.runner import StepRunner, state_layout
from qtts.decode_engine.snake_gemm import snake_gemm
from qtts.decode_engine.snake_nwc import snake_nwc, snake_nwc_paired, triton_available
from qtts.decode_engine.snakebeta import snake_factors, snake_reference

SPF = 1920
# fp32 end to end: the two layouts only sum in a different order (measured ~4e-6 on outputs of
# magnitude ~1); 1e-4 absolute is 1e-4 relative to the clamp range.
ATOL = 1e-4
FAST = ("channels_last", "channels_last_fused")


def _codes(t: int, seed: int, batch: int | None = None) -> torch.Tensor:
    shape = (t, 16) if batch is None else (batch, t, 16)
    return torch.randint(0, 2048, shape, generator=torch.Generator().manual_seed(seed))


def _compositions(total: int):
    """Every way to cut `total` frames into ordered chunks of >= 1 frame."""
    for cuts in itertools.product((False, True), repeat=total - 1):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield [*sizes, run]


def test_history_layout_is_time_major_for_the_conv_stack_only(tiny_codec_decoder):
    first = state_layout(tiny_codec_decoder)
    last = state_layout(tiny_codec_decoder, time_major=True)
    assert first.keys() == last.keys()
    for key, shape in first.items():
        moved = key.startswith(("upsample.", "decoder.")) and len(shape) == 2
        assert last[key] == (shape[::-1] if moved else shape)
    assert any(first[k] != last[k] for k in first)


def test_every_partition_of_the_frames_equals_the_full_decode(tiny_codec_decoder):
    """All 64 ways to cut 7 frames into chunks, 3 streams a batch, every layout, fp32."""
    dec = tiny_codec_decoder
    codes = _codes(7, seed=3, batch=3)
    full = dec.decode(codes)
    runners = {cs: StepRunner(dec, 3, conv_stack=cs) for cs in ("channels_first", *FAST)}
    parts = list(_compositions(7))
    assert len(parts) == 64 and [1] * 7 in parts
    for sizes in parts:
        got = {}
        for cs, run in runners.items():
            for buf in run.pool.buffers.values():
                buf.zero_()
            pieces, off = [], 0
            for n in sizes:
                pieces.append(run.run_eager([0, 1, 2], [off] * 3, list(codes[:, off : off + n])))
                off += n
            got[cs] = torch.cat(pieces, dim=1)
        for cs in FAST:
            torch.testing.assert_close(got[cs], full, atol=ATOL, rtol=0, msg=f"{cs} chunks {sizes}")
            torch.testing.assert_close(got[cs], got["channels_first"], atol=ATOL, rtol=0)
    assert full.abs().max() > 0.1  # not a trivially silent output


@pytest.mark.parametrize("conv_stack", FAST)
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-buffers"])
def test_late_joins_at_every_batch_bucket_equal_one_full_decode(tiny_codec_decoder, static, conv_stack):
    """Streams join one by one (1..8 live: buckets 1, 2, 4 and 8, padded rows in between), each at
    its own position, chunk sizes captured and not; every stream equals its own full decode."""
    engine = SlotDecoder(
        tiny_codec_decoder,
        SlotDecoderConfig(
            max_streams=8,
            precision="fp32",
            emulate_graphs=static,
            batch_sizes=(1, 2, 4, 8),
            chunk_sizes=(1, 2, 4),
            conv_stack=conv_stack,
        ),
    )
    engine.capture()
    assert engine.runner.conv_stack == conv_stack
    streams = [_codes(40, seed=20 + i) for i in range(8)]
    states, outs, offs = [], [], []
    for step in range(10):
        if len(states) < 8:
            states.append(engine.start())
            outs.append([])
            offs.append(0)
        sizes = [(step + i) % 3 + 1 for i in range(len(states))]  # 1-3 frames: 3 is split or eager
        chunks = [s[o : o + n] for s, o, n in zip(streams, offs, sizes, strict=False)]
        for i, wav in enumerate(engine.decode_batch(states, chunks)):
            outs[i].append(wav)
            offs[i] += sizes[i]
    for i, state in enumerate(states):
        want = tiny_codec_decoder.decode(streams[i][: offs[i]])
        torch.testing.assert_close(torch.cat(outs[i]), want, atol=ATOL, rtol=0)
        assert state.frames == offs[i]


def test_prefix_and_mixed_chunks_match_the_reference_layout(tiny_codec_decoder):
    """An ICL prefix (trimmed tail path) then chunks past the attention window, both layouts."""
    outs = {}
    prefix, codes = _codes(30, seed=40), _codes(90, seed=41)
    for cs in ("channels_first", *FAST):
        engine = SlotDecoder(tiny_codec_decoder, SlotDecoderConfig(max_streams=2, conv_stack=cs))
        state = engine.start(prefix)
        outs[cs] = torch.cat([engine.decode(state, codes[o : o + 25]) for o in range(0, 90, 25)])
    want = tiny_codec_decoder.decode(torch.cat([prefix, codes]))[30 * SPF :]
    for cs in FAST:
        torch.testing.assert_close(outs[cs], want, atol=ATOL, rtol=0)
        torch.testing.assert_close(outs[cs], outs["channels_first"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("conv_stack", FAST)
def test_bf16_channels_last_snr_against_fp32(tiny_codec_decoder, conv_stack):
    def snr(ref: torch.Tensor, x: torch.Tensor) -> float:
        noise = (ref.double() - x.double()).pow(2).sum()
        return 10.0 * torch.log10(ref.double().pow(2).sum() / noise).item()

    codes = _codes(40, seed=5, batch=3)
    full = tiny_codec_decoder.decode(codes)
    run = StepRunner(tiny_codec_decoder, 3, precision="bf16", conv_stack=conv_stack)
    got = torch.cat(
        [run.run_eager([0, 1, 2], [o] * 3, list(codes[:, o : o + 8])) for o in range(0, 40, 8)], 1
    )
    assert run.pool.buffers["decoder.0"].dtype == torch.bfloat16
    # The reference layout measures ~36 dB here; a wrong row or history gives < 5 dB.
    assert 30.0 <= snr(full, got) < 100


def test_unknown_conv_stack_is_refused(tiny_codec_decoder):
    with pytest.raises(ValueError, match="conv_stack"):
        SlotDecoderConfig(conv_stack="nhwc")
    with pytest.raises(ValueError, match="conv_stack"):
        StepRunner(tiny_codec_decoder, 1, conv_stack="nhwc")


# ---------------------------------------------------------------------------------- Triton passes

needs_triton = pytest.mark.skipif(
    not triton_available(torch.zeros(1)) and not torch.cuda.is_available(),
    reason="needs Triton on CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _factors(c: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    alpha_log, beta_log = 0.5 * torch.randn(c, generator=g), 0.5 * torch.randn(c, generator=g)
    return alpha_log, beta_log, snake_factors(alpha_log.to(DEVICE), beta_log.to(DEVICE))


@needs_triton
@pytest.mark.parametrize("fused", ["plain", "bias", "bias+residual"])
def test_triton_snake_nwc_equals_torch_and_the_formula(fused):
    alpha_log, beta_log, (alpha, inv_beta) = _factors(6, 1)
    g = torch.Generator().manual_seed(2)
    x, res, hist = (torch.randn(s, generator=g) for s in ((2, 9, 6), (2, 9, 6), (2, 4, 6)))
    bias = torch.randn(6, generator=g) if fused != "plain" else None
    res = res if fused == "bias+residual" else None
    args = [t.to(DEVICE) if t is not None else None for t in (x, hist)]
    kw = {
        "bias": None if bias is None else bias.to(DEVICE),
        "residual": None if res is None else res.to(DEVICE),
    }
    got, total = snake_nwc(*args, alpha, inv_beta, want_sum=True, use_triton=True, **kw)
    ref, ref_total = snake_nwc(*args, alpha, inv_beta, want_sum=True, use_triton=False, **kw)
    v = x + (0 if bias is None else bias) + (0 if res is None else res)
    want = torch.cat([hist, snake_reference(v.transpose(1, 2), alpha_log, beta_log).transpose(1, 2)], dim=1)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(total.cpu(), v, atol=1e-6, rtol=0)
    torch.testing.assert_close(ref_total.cpu(), v, atol=1e-6, rtol=0)


@needs_triton
def test_triton_paired_layout_equals_torch():
    alpha_log, beta_log, (alpha, inv_beta) = _factors(5, 3)
    g = torch.Generator().manual_seed(4)
    x, hist, bias = (
        torch.randn(3, 7, 5, generator=g),
        torch.randn(3, 1, 5, generator=g),
        torch.randn(5, generator=g),
    )
    got = snake_nwc_paired(
        x.to(DEVICE), hist.to(DEVICE), alpha, inv_beta, bias=bias.to(DEVICE), use_triton=True
    )
    act = snake_reference((x + bias).transpose(1, 2), alpha_log, beta_log).transpose(1, 2)
    want = torch.cat([torch.cat([hist, act[:, :-1]], dim=1), act], dim=2)
    assert got.shape == (3, 7, 10)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("width", [(24, 24), (4, 4), (96, 40)], ids=["24", "4", "96to40"])
@pytest.mark.parametrize("mode", ["next-unit", "next-block", "none"])
def test_triton_snake_gemm_equals_torch(width, mode):
    """x_new and the next consumer's input: the next unit's (after a 6-step history), the next
    block's paired rows (after a 1-step history, x_new not written), or none."""
    k, n = width
    g = torch.Generator().manual_seed(6)
    y, res = torch.randn(2, 37, k, generator=g), torch.randn(2, 37, n, generator=g)
    w2t = torch.randn(k, n, generator=g) / k**0.5
    hist = torch.randn(2, 1 if mode == "next-block" else 6, n, generator=g)
    b1, b2 = torch.randn(k, generator=g), torch.randn(n, generator=g)
    act2 = _factors(k, 7)[2]
    act1 = _factors(n, 8)[2] if mode != "none" else None
    args = [t.to(DEVICE) for t in (y, b1)], [t.to(DEVICE) for t in (w2t, b2, res)]
    history = hist.to(DEVICE) if mode != "none" else None
    kw = {"paired": mode == "next-block", "want_x": mode != "next-block"}
    got = snake_gemm(*args[0], act2, *args[1], act1, history, use_triton=True, **kw)
    ref = snake_gemm(*args[0], act2, *args[1], act1, history, use_triton=False, **kw)
    # The formula, spelled out once more.
    v = y + b1
    a2, ib2 = (t.cpu() for t in act2)
    x_new = (v + ib2 * torch.sin(v * a2) ** 2) @ w2t + b2 + res
    if mode == "next-block":
        assert got[0] is None and ref[0] is None
    else:
        torch.testing.assert_close(got[0].cpu(), x_new, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    if mode == "none":
        assert got[1] is None and ref[1] is None
        return
    a1, ib1 = (t.cpu() for t in act1)
    act = x_new + ib1 * torch.sin(x_new * a1) ** 2
    if mode == "next-block":
        want = torch.cat([torch.cat([hist, act[:, :-1]], dim=1), act], dim=2)
        assert got[1].shape == (2, 37, 2 * n)
    else:
        want = torch.cat([hist, act], dim=1)
        assert got[1].shape == (2, 43, n)
    torch.testing.assert_close(got[1].cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="slow"
)
@pytest.mark.parametrize("conv_stack", FAST)
def test_conv_stack_with_triton_passes_equals_the_full_decode(tiny_codec_decoder, conv_stack):
    """The whole channels-last step with its Triton passes (tiny: 1 stream, 1 + 1 frames)."""
    dec = tiny_codec_decoder
    codes = _codes(2, seed=9, batch=1)
    run = StepRunner(dec, 1, conv_stack=conv_stack)
    run.convs.use_triton = True
    got = torch.cat([run.run_eager([0], [0], [codes[0, :1]]), run.run_eager([0], [1], [codes[0, 1:]])], 1)
    torch.testing.assert_close(got, dec.decode(codes), atol=ATOL, rtol=0)
