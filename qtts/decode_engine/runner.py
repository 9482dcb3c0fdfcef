"""The static-shape batched decode step over pool slots, with CUDA graphs and three precisions.

One step decodes `n` new frames for each of `B` streams named by their pool slots:
RVQ dequant -> pre-conv -> 8-layer sliding-window transformer over a ring KV window -> two
upsampling rounds -> conv + 4 SnakeBeta blocks -> conv -> clamp. It reuses the parameters of
`qtts.model.codec_decoder.CodecDecoder` (same modules, same math) but reads and writes each
stream's history in the `SlotPool` instead of per-stream dicts, so every tensor shape depends only
on (B, n) and the whole step can be captured once per (batch bucket, chunk size) and replayed.

Inputs travel as one int64 vector `[slots(B) | positions(B) | codes(B*n*Q)]`: one host-to-device
copy per step. Outputs land in one float32 buffer shared by all graphs and are copied out once.

Precision: "fp32" (strict, the reference), "tf32" (fp32 storage, TF32 matmuls and convs),
"bf16" (a bf16 copy of the weights and state; RVQ tables folded in fp32, norms and softmax in fp32,
SnakeBeta in fp32 registers).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qtts.decode_engine.slots import SlotPool
from qtts.decode_engine.snakebeta import bias_add, snake, snake_after_history, snake_factors
from qtts.model.codec_decoder import (
    CausalConv1d,
    CausalTransConv1d,
    CodecDecoder,
    ConvNeXtBlock,
    SlidingAttention,
    SnakeBeta,
)

PRECISIONS = ("fp32", "tf32", "bf16")


@contextlib.contextmanager
def precision_flags(precision: str, device: torch.device) -> Iterator[None]:
    """TF32 on or off for CUDA matmuls and convs while tracing or running a step eagerly."""
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def state_layout(decoder: CodecDecoder) -> dict[str, tuple[int, ...]]:
    """Per-slot shape of every carried history, keyed like the decoder's own stream cache."""
    layout: dict[str, tuple[int, ...]] = {}
    for _, mod in decoder.named_modules():
        if isinstance(mod, CausalConv1d | CausalTransConv1d) and mod.history:
            layout[mod.key] = (mod.conv.in_channels, mod.history)
        elif isinstance(mod, SlidingAttention):
            shape = (mod.kv_heads, mod.window, mod.head_dim)
            layout[mod.key + "k"] = shape
            layout[mod.key + "v"] = shape
    return layout


def conv_stack_receptive_frames(decoder: CodecDecoder) -> int:
    """Frames of input the upsampler + decoder convs see before a frame (their total history).

    Decoding the conv stack from zero history over the last R >= this many frames of a prefix
    leaves exactly the history a decode of the whole prefix would leave."""
    frames = 0.0
    for name, mod in decoder.named_modules():
        if not name.startswith(("upsample.", "decoder.")):
            continue
        if isinstance(mod, CausalConv1d | CausalTransConv1d) and mod.history:
            frames += mod.history / mod.rate
    return math.ceil(frames) + 1


@dataclass
class _StaticStep:
    """One captured (batch, frames) shape: its input/output views and how to run it."""

    batch: int
    frames: int
    inputs: torch.Tensor  # int64 view into the shared input buffer
    outputs: torch.Tensor  # [batch, frames * spf] float32 view into the shared output buffer
    replay: Callable[[], None]


class StepRunner:
    """Batched stateful decode steps over a `SlotPool`; eager for any shape, graphs for captured."""

    def __init__(
        self,
        decoder: CodecDecoder,
        capacity: int,
        *,
        precision: str = "fp32",
        emulate_graphs: bool = False,
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision != "bf16" and decoder.dtype != torch.float32:
            raise ValueError(f"precision {precision} needs a float32 decoder, got {decoder.dtype}")
        self.precision = precision
        self.device = decoder.device
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        # The bf16 path keeps its own copy: the fp32 reference weights stay untouched.
        self.model = decoder if decoder.dtype == self.dtype else copy.deepcopy(decoder).to(self.dtype)
        self.model.eval()
        cfg = decoder.cfg
        self.cfg = cfg
        self.num_quantizers = cfg.num_quantizers
        self.samples_per_frame = decoder.samples_per_frame
        self.window = cfg.sliding_window
        self.pool = SlotPool(state_layout(self.model), capacity, device=self.device, dtype=self.dtype)
        self.prefix_tail_frames = conv_stack_receptive_frames(self.model)
        self._rvq_table, self._rvq_offsets = self._fold_rvq(decoder)
        # RoPE frequencies from the fp32 reference: a bf16 copy would round them, and the error
        # grows with the distance between positions.
        self._inv_freq = decoder.pre_transformer.inv_freq.detach().float().clone()
        # SnakeBeta factors from the fp32 parameters too (the model copy has the same module order).
        self._snake = {
            id(mine): snake_factors(ref.alpha, ref.beta)
            for ref, mine in zip(decoder.modules(), self.model.modules(), strict=True)
            if isinstance(mine, SnakeBeta)
        }
        self._emulate = emulate_graphs and self.device.type != "cuda"
        self._graphs: dict[tuple[int, int], _StaticStep] = {}
        self._in: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._host_in: torch.Tensor | None = None
        self._h2d_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self._graph_pool = None

    # ------------------------------------------------------------------ parameters

    def _fold_rvq(self, decoder: CodecDecoder) -> tuple[torch.Tensor, torch.Tensor]:
        """One table [Q * size, codebook_dim]: each codebook vector already through its group's
        1x1 output projection (linear, so projecting before the sum equals projecting after)."""
        tables = []
        with torch.no_grad():
            for group in (decoder.quantizer.rvq_first, decoder.quantizer.rvq_rest):
                proj = group.output_proj.weight.detach().float()[:, :, 0]  # [io_dim, dim]
                for layer in group.vq.layers:
                    tables.append(layer._codebook.table().detach().float() @ proj.t())
        size = self.cfg.codebook_size
        offsets = torch.arange(len(tables), device=self.device, dtype=torch.long) * size
        return torch.cat(tables).to(device=self.device, dtype=self.dtype).contiguous(), offsets

    # ------------------------------------------------------------------ the step

    def forward(
        self, codes: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, frame_only: bool = False
    ) -> torch.Tensor | None:
        """Decode codes [B, n, Q] of the streams in `slots` at `positions`; returns [B, n*spf] float32.

        Every row must hold `n` valid frames. Reads and writes the slots' history in the pool.
        `frame_only` stops after the transformer (used for the early part of a long prefix)."""
        m = self.model
        b, n, _ = codes.shape
        # Out-of-range codes must never reach the gather: on CUDA that is a device assert that
        # poisons the whole process (the service validates codes; this is the last line).
        idx = codes.clamp(min=0, max=self.cfg.codebook_size - 1) + self._rvq_offsets
        h = F.embedding(idx, self._rvq_table).sum(dim=2).transpose(1, 2)  # [B, codebook_dim, n]
        h = self._conv(m.pre_conv, h, slots)
        h = self._transformer(h.transpose(1, 2), slots, positions)
        if frame_only:
            return None
        h = h.transpose(1, 2)
        for trans, block in m.upsample:
            h = self._trans_conv(trans, h, slots)
            h = self._convnext(block, h, slots)
        # From here on the tensors are large (up to 1920 steps per frame): each conv's bias is
        # added by the next elementwise pass (SnakeBeta, or the residual add) instead of its own.
        layers = m.decoder
        h, bias = self._conv_deferred(layers[0], h, slots)
        for blk in layers[1:-2]:
            act, trans, *units = blk.block
            full = self._with_history(trans, h, slots, act, bias)
            y = F.conv_transpose1d(full, trans.conv.weight, None, stride=trans.stride)
            start = trans.history * trans.stride
            h = _add_bias(y[..., start : start + h.shape[-1] * trans.stride], trans.conv.bias)
            for unit in units:
                h1, b1 = self._conv_deferred(unit.conv1, h, slots, unit.act1)
                h2, b2 = self._conv_deferred(unit.conv2, h1, slots, unit.act2, b1)
                h = _add_bias(h2, b2, residual=h)
            bias = None
        h = self._conv(layers[-1], h, slots, layers[-2])
        return h.clamp(min=-1.0, max=1.0).reshape(b, n * self.samples_per_frame).float()

    def _act_input(
        self, x: torch.Tensor, hist: torch.Tensor | None, act: SnakeBeta | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if act is None:
            x = x if bias is None else _add_bias(x, bias)
            return x if hist is None else torch.cat([hist, x], dim=2)
        alpha, inv_beta = self._snake[id(act)]
        if hist is None:
            return snake(x, alpha, inv_beta, bias)
        return snake_after_history(x, hist, alpha, inv_beta, bias)

    def _with_history(
        self,
        mod: CausalConv1d | CausalTransConv1d,
        x: torch.Tensor,
        slots: torch.Tensor,
        act: SnakeBeta | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """cat(history, act(x + bias)) for the layer, writing the new history back to the pool."""
        if not mod.history:
            return self._act_input(x, None, act, bias)
        buf = self.pool.buffers[mod.key]
        full = self._act_input(x, buf.index_select(0, slots), act, bias)
        buf.index_copy_(0, slots, full[:, :, full.shape[2] - mod.history :])
        return full

    def _conv(
        self, mod: CausalConv1d, x: torch.Tensor, slots: torch.Tensor, act: SnakeBeta | None = None
    ) -> torch.Tensor:
        return mod.conv(self._with_history(mod, x, slots, act))

    def _conv_deferred(
        self,
        mod: CausalConv1d,
        x: torch.Tensor,
        slots: torch.Tensor,
        act: SnakeBeta | None = None,
        in_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The conv without its bias, and the bias for the consumer to add."""
        c = mod.conv
        full = self._with_history(mod, x, slots, act, in_bias)
        return F.conv1d(full, c.weight, None, c.stride, 0, c.dilation, c.groups), c.bias

    def _trans_conv(
        self, mod: CausalTransConv1d, x: torch.Tensor, slots: torch.Tensor, act: SnakeBeta | None = None
    ) -> torch.Tensor:
        out_len = x.shape[-1] * mod.stride
        start = mod.history * mod.stride
        return mod.conv(self._with_history(mod, x, slots, act))[..., start : start + out_len]

    def _convnext(self, block: ConvNeXtBlock, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = self._conv(block.dwconv, x, slots).transpose(1, 2)
        h = block.pwconv2(block.act(block.pwconv1(block.norm(h))))
        return x + (block.gamma * h).transpose(1, 2)

    def _transformer(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, n, latent] -> [B, n, latent]; keys/values of the last `window` positions live in
        ring column `position % window` of each slot, so only the n new columns are written."""
        t = self.model.pre_transformer
        b, n, _ = x.shape
        w = self.window
        dev = x.device
        q_pos = positions.view(b, 1) + torch.arange(n, device=dev).view(1, n)  # [B, n]
        cols = torch.arange(w, device=dev).view(1, w)
        # Ring column j holds the one position p < positions with p % w == j and p >= positions - w.
        ring_pos = positions.view(b, 1) - w + torch.remainder(cols - positions.view(b, 1), w)
        k_pos = torch.cat([ring_pos, q_pos], dim=1)  # [B, w + n]
        qp, kp = q_pos.unsqueeze(2), k_pos.unsqueeze(1)
        allowed = ((kp >= 0) & (kp <= qp) & (kp > qp - w)).unsqueeze(1)  # [B, 1, n, w + n]
        freqs = q_pos.float().unsqueeze(-1) * self._inv_freq.view(1, 1, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos().to(x.dtype).unsqueeze(1)
        sin = emb.sin().to(x.dtype).unsqueeze(1)
        write_rows = slots.view(b, 1).expand(b, n)
        write_cols = torch.remainder(q_pos, w)
        h = t.input_proj(x)
        for layer in t.layers:
            attn = self._attention(
                layer.self_attn, layer.input_layernorm(h), cos, sin, allowed, slots, write_rows, write_cols
            )
            h = h + layer.self_attn_layer_scale(attn)
            h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
        return t.output_proj(t.norm(h))

    def _attention(
        self,
        a: SlidingAttention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        slots: torch.Tensor,
        write_rows: torch.Tensor,
        write_cols: torch.Tensor,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = a.q_proj(x).view(b, n, a.heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, n, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, n, a.kv_heads, a.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_buf, v_buf = self.pool.buffers[a.key + "k"], self.pool.buffers[a.key + "v"]
        k_all = torch.cat([k_buf.index_select(0, slots), k], dim=2)  # [B, kv, w + n, D]
        v_all = torch.cat([v_buf.index_select(0, slots), v], dim=2)
        k_buf[write_rows, :, write_cols] = k.transpose(1, 2)
        v_buf[write_rows, :, write_cols] = v.transpose(1, 2)
        # A plain matmul-softmax-matmul: at most window + n keys, and the softmax in fp32.
        rep = a.heads // a.kv_heads
        qg = q.reshape(b, a.kv_heads, rep * n, a.head_dim)
        scores = torch.matmul(qg, k_all.transpose(2, 3)).float() * (a.head_dim**-0.5)
        scores = scores.view(b, a.kv_heads, rep, n, -1).masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v_all.dtype).view(b, a.kv_heads, rep * n, -1)
        out = torch.matmul(probs, v_all).view(b, a.heads, n, a.head_dim)
        return a.o_proj(out.transpose(1, 2).reshape(b, n, a.heads * a.head_dim))

    # ------------------------------------------------------------------ eager entry points

    @torch.inference_mode()
    def run_eager(
        self,
        slots: Sequence[int],
        positions: Sequence[int],
        codes: Sequence[torch.Tensor],
        frame_only: bool = False,
    ) -> torch.Tensor | None:
        """One step for rows of equal length, any shape, no graph."""
        dev = self.device
        slot_t = torch.tensor(list(slots), dtype=torch.long, device=dev)
        pos_t = torch.tensor(list(positions), dtype=torch.long, device=dev)
        code_t = torch.stack([c.to(device=dev, dtype=torch.long) for c in codes])
        with precision_flags(self.precision, dev):
            return self.forward(code_t, slot_t, pos_t, frame_only)

    # ------------------------------------------------------------------ static shapes

    def _input_len(self, batch: int, frames: int) -> int:
        return batch * (2 + frames * self.num_quantizers)

    def capture(self, shapes: Sequence[tuple[int, int]], *, cudnn_benchmark: bool = True) -> int:
        """Capture a graph per (batch, frames) shape, largest first, into one memory pool.

        On CPU with `emulate_graphs`, the same static buffers are set up and "replay" runs the
        step eagerly on them, so the padding and buffer logic is testable without a GPU."""
        shapes = sorted(set(shapes), key=lambda s: (s[0] * s[1], s[0]), reverse=True)
        if not shapes or (self.device.type != "cuda" and not self._emulate):
            return 0
        if self._graphs:
            raise RuntimeError("capture() runs once: pass every shape in one call (one memory pool)")
        if any(f > self.window for _, f in shapes):
            raise ValueError(f"captured chunks must be at most {self.window} frames")
        max_in = max(self._input_len(b, f) for b, f in shapes)
        max_out = max(b * f for b, f in shapes) * self.samples_per_frame
        self._in = torch.zeros(max_in, dtype=torch.long, device=self.device)
        self._out = torch.zeros(max_out, dtype=torch.float32, device=self.device)
        self._host_in = torch.zeros(max_in, dtype=torch.long, pin_memory=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._graph_pool = torch.cuda.graph_pool_handle()
        prev_bench = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = cudnn_benchmark
        try:
            for batch, frames in shapes:
                self._graphs[(batch, frames)] = self._capture_one(batch, frames)
        finally:
            torch.backends.cudnn.benchmark = prev_bench
        return len(self._graphs)

    def captured_shapes(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def _capture_one(self, batch: int, frames: int) -> _StaticStep:
        inputs = self._in[: self._input_len(batch, frames)]
        outputs = self._out[: batch * frames * self.samples_per_frame].view(batch, -1)
        q = self.num_quantizers

        def body() -> None:
            slots = inputs[:batch]
            positions = inputs[batch : 2 * batch]
            codes = inputs[2 * batch :].view(batch, frames, q)
            outputs.copy_(self.forward(codes, slots, positions))

        # Capture-time runs write to the padding slot only.
        with torch.inference_mode():
            inputs.zero_()
            inputs[:batch] = self.pool.padding_slot
        if self.device.type != "cuda":
            return _StaticStep(batch, frames, inputs, outputs, torch.inference_mode()(body))
        with torch.inference_mode(), precision_flags(self.precision, self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: cuDNN algorithm choice, Triton compile, allocator
                    body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                body()
        torch.cuda.synchronize()
        return _StaticStep(batch, frames, inputs, outputs, graph.replay)

    def has_graph(self, batch: int, frames: int) -> bool:
        return (batch, frames) in self._graphs

    @torch.inference_mode()
    def run_static(
        self, batch: int, slots: Sequence[int], positions: Sequence[int], codes: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Replay the captured (batch, n) step for len(slots) <= batch real rows; padding rows use
        the padding slot. Returns the real rows' samples [rows, n*spf] (a view: read it before the
        next step)."""
        rows = len(slots)
        frames = codes[0].shape[0]
        static = self._graphs[(batch, frames)]
        pad = batch - rows
        slot_list = list(slots) + [self.pool.padding_slot] * pad
        pos_list = list(positions) + [0] * pad
        n_codes = frames * self.num_quantizers
        real, length = 2 * batch + rows * n_codes, 2 * batch + batch * n_codes
        if codes[0].device.type == "cuda":
            # Codes already on the device: one gather on the device, one small host copy.
            head = torch.tensor(slot_list + pos_list, dtype=torch.long)
            static.inputs[: 2 * batch].copy_(head)
            static.inputs[2 * batch : real].copy_(torch.stack(list(codes)).reshape(-1))
            static.inputs[real:length].zero_()
        else:
            host = self._host_in
            if self._h2d_done is not None:
                self._h2d_done.synchronize()  # the previous step's copy has left the host buffer
            host[: 2 * batch] = torch.tensor(slot_list + pos_list, dtype=torch.long)
            torch.stack(list(codes), out=host[2 * batch : real].view(rows, frames, -1))
            # Padding rows decode code 0: the buffer may hold a larger step's slots and positions.
            host[real:length] = 0
            static.inputs[:length].copy_(host[:length], non_blocking=True)
            if self._h2d_done is not None:
                self._h2d_done.record()
        static.replay()
        return static.outputs[:rows]


def _add_bias(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if bias is None:
        return x.contiguous() if residual is None else x + residual
    return bias_add(x, bias, residual)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
