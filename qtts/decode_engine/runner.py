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

The step is `frame_stage.FrameStage` (RVQ, pre-conv, transformer: frame rate) followed by a conv
stack, chosen by `conv_stack` (see CONV_STACKS): the channels-first reference (`conv_stack`) or the
time-major ones (`conv_stack_cl`), which compute the same within float rounding.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from qtts.decode_engine.conv_stack import ConvStack
from qtts.decode_engine.conv_stack_cl import ChannelsLastConvStack
from qtts.decode_engine.frame_stage import FrameStage
from qtts.decode_engine.slots import SlotPool
from qtts.model.codec_decoder import CausalConv1d, CausalTransConv1d, CodecDecoder, SlidingAttention

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "tf32", "bf16")
# "channels_first": the checkpoint's [B, C, T] layout (`conv_stack.ConvStack`, the reference);
# "channels_last": [B, T, C] with GEMMs, NHWC convs and fused SnakeBeta passes (`conv_stack_cl`);
# "channels_last_fused": the same with each residual unit's tail as one GEMM pass (`snake_gemm`).
CONV_STACKS = ("channels_first", "channels_last", "channels_last_fused")


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


def state_layout(decoder: CodecDecoder, time_major: bool = False) -> dict[str, tuple[int, ...]]:
    """Per-slot shape of every carried history, keyed like the decoder's own stream cache.

    `time_major` lays the conv stack's histories out as [steps, channels] (the channels-last
    conv stack); the frame-rate pre-conv and the attention windows keep their own layout."""
    layout: dict[str, tuple[int, ...]] = {}
    for name, mod in decoder.named_modules():
        if isinstance(mod, CausalConv1d | CausalTransConv1d) and mod.history:
            shape = (mod.conv.in_channels, mod.history)
            if time_major and name.startswith(("upsample.", "decoder.")):
                shape = shape[::-1]
            layout[mod.key] = shape
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
        conv_stack: str = "channels_first",
    ):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if conv_stack not in CONV_STACKS:
            raise ValueError(f"conv_stack must be one of {CONV_STACKS}, got {conv_stack!r}")
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
        self.conv_stack = conv_stack
        channels_last = conv_stack.startswith("channels_last")
        layout = state_layout(self.model, time_major=channels_last)
        self.pool = SlotPool(layout, capacity, device=self.device, dtype=self.dtype)
        self.prefix_tail_frames = conv_stack_receptive_frames(self.model)
        self.frames = FrameStage(self.model, decoder, self.pool, self.dtype)
        self.convs: ConvStack | ChannelsLastConvStack = (
            ChannelsLastConvStack(self.model, decoder, self.pool, fused=conv_stack.endswith("_fused"))
            if channels_last
            else ConvStack(self.model, decoder, self.pool)
        )
        self._emulate = emulate_graphs and self.device.type != "cuda"
        self._graphs: dict[tuple[int, int], _StaticStep] = {}
        self._in: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._host_in: torch.Tensor | None = None
        self._h2d_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self._graph_pool = None

    # ------------------------------------------------------------------ the step

    def forward(
        self, codes: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, frame_only: bool = False
    ) -> torch.Tensor | None:
        """Decode codes [B, n, Q] of the streams in `slots` at `positions`; returns [B, n*spf] float32.

        Every row must hold `n` valid frames. Reads and writes the slots' history in the pool.
        `frame_only` stops after the transformer (used for the early part of a long prefix)."""
        h = self.frames.run(codes, slots, positions)
        return None if frame_only else self.convs.run(h, slots)

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
        start = time.monotonic()
        took: dict[tuple[int, int], float] = {}
        try:
            for batch, frames in shapes:
                t0 = time.monotonic()
                self._graphs[(batch, frames)] = self._capture_one(batch, frames)
                took[(batch, frames)] = time.monotonic() - t0
                log.debug(
                    "decoder: captured (batch %d, %d frames) in %.2f s", batch, frames, took[(batch, frames)]
                )
        finally:
            torch.backends.cudnn.benchmark = prev_bench
        slowest = sorted(took, key=took.__getitem__, reverse=True)[:3]
        log.info(
            "decoder: captured %d graphs in %.1f s (cuDNN benchmark %s; slowest: %s)",
            len(self._graphs),
            time.monotonic() - start,
            "on" if cudnn_benchmark else "off",
            ", ".join(f"{b}x{f} {took[(b, f)]:.1f} s" for b, f in slowest),
        )
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
