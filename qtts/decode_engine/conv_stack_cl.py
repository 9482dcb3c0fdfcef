"""The conv stack of a decode step in a time-major (channels-last) layout [B, T, C].

Same math as `conv_stack.ConvStack` (the checkpoint's channels-first layout), laid out for the
GPU's GEMM and NHWC convolution kernels:

- the transformer's output is already [B, n, C]: no transposes anywhere;
- 1x1 convs and the ConvNeXt MLP are plain matmuls over (B*T, C) rows, bias in the GEMM epilogue;
- a transposed conv with kernel = stride (upsampler) is one GEMM to r*Cout columns, which *is* the
  upsampled output [B, T*r, Cout]; a transposed conv with kernel = 2 * stride (decoder blocks) is one
  GEMM too, over rows (act[t-1], act[t]) that the SnakeBeta before it writes side by side
  (polyphase: output phase p of step t takes taps p and p + r);
- k-tap causal convs are NHWC convolutions (cuDNN's fast layout for bf16);
- every SnakeBeta also adds the pending bias and residual of the layers before it, and writes its
  activation straight after the carried history in the next conv's input (`snake_nwc`), so no
  layer spends a pass of its own on a bias, a residual add or a concatenation.

Histories live in the `SlotPool` time-major too: a conv's history is [h, C] per slot
(`state_layout(..., time_major=True)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qtts.decode_engine.conv_stack import snake_table
from qtts.decode_engine.slots import SlotPool
from qtts.decode_engine.snake_gemm import snake_gemm
from qtts.decode_engine.snake_nwc import snake_nwc, snake_nwc_paired
from qtts.model.codec_decoder import CausalConv1d, CodecDecoder, ResidualUnit, SnakeBeta


@dataclass
class _Conv:
    """A causal k-tap conv as an NHWC conv2d: weight [Cout, Cin/groups, 1, k] (channels-last)."""

    key: str
    weight: torch.Tensor
    bias: torch.Tensor
    history: int
    dilation: int
    groups: int


def _conv(mod: CausalConv1d) -> _Conv:
    c = mod.conv
    w = c.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return _Conv(mod.key, w, c.bias.detach(), mod.history, c.dilation[0], c.groups)


@dataclass
class _Unit:
    act1: tuple[torch.Tensor, torch.Tensor]
    conv1: _Conv
    act2: tuple[torch.Tensor, torch.Tensor]
    w2: torch.Tensor  # [Cout, Cin] linear weight of the 1x1 conv
    w2t: torch.Tensor  # [Cin, Cout], for the fused GEMM
    b2: torch.Tensor


def _unit(unit: ResidualUnit, snakes: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> _Unit:
    w = unit.conv2.conv.weight.detach()[:, :, 0]
    return _Unit(
        snakes[id(unit.act1)],
        _conv(unit.conv1),
        snakes[id(unit.act2)],
        w.contiguous(),
        w.t().contiguous(),
        unit.conv2.conv.bias.detach(),
    )


@dataclass
class _Block:
    act: tuple[torch.Tensor, torch.Tensor]
    key: str  # the transposed conv's carried input step
    weight: torch.Tensor  # [r * Cout, 2 * Cin]: columns (prev | own) step, rows (phase, channel)
    bias: torch.Tensor  # [r * Cout]
    stride: int
    units: list[_Unit]


def _paired_weight(conv: torch.nn.ConvTranspose1d, r: int) -> torch.Tensor:
    w = conv.weight.detach()  # [Cin, Cout, 2r]; output phase p of step t: taps p (own), p + r (prev)
    both = torch.cat([w[:, :, r:], w[:, :, :r]], dim=0)  # [2 Cin, Cout, r]
    return both.permute(2, 1, 0).reshape(r * w.shape[1], 2 * w.shape[0]).contiguous()


class ChannelsLastConvStack:
    """Transformer output [B, n, latent] -> clamped waveform [B, n * spf] float32, time-major.

    `fused` runs each residual unit's SnakeBeta, 1x1 conv, residual add and the next unit's
    SnakeBeta as one GEMM pass (`snake_gemm`). `use_triton` forces (True) or forbids (False) the
    Triton kernels; None means "on CUDA"."""

    def __init__(
        self,
        model: CodecDecoder,
        reference: CodecDecoder,
        pool: SlotPool,
        *,
        fused: bool = False,
        use_triton: bool | None = None,
    ):
        self.pool = pool
        self.samples_per_frame = model.samples_per_frame
        self.fused = fused
        self.use_triton = use_triton
        snakes = snake_table(reference, model)
        self._upsample = []
        for trans, block in model.upsample:
            w = trans.conv.weight.detach()  # [Cin, Cout, r], kernel = stride: no history
            r = trans.stride
            lin = w.permute(2, 1, 0).reshape(r * w.shape[1], w.shape[0]).contiguous()
            self._upsample.append(
                (lin, trans.conv.bias.detach().repeat(r), w.shape[1], _conv(block.dwconv), block)
            )
        layers = model.decoder
        self._first = _conv(layers[0])
        self._blocks: list[_Block] = []
        for blk in layers[1:-2]:
            act, trans, *units = blk.block
            if trans.conv.kernel_size[0] != 2 * trans.stride:  # the paired GEMM takes two taps
                raise ValueError(f"{trans.key}: the channels-last stack needs kernel = 2 x stride")
            self._blocks.append(
                _Block(
                    snakes[id(act)],
                    trans.key,
                    _paired_weight(trans.conv, trans.stride),
                    trans.conv.bias.detach().repeat(trans.stride),
                    trans.stride,
                    [_unit(u, snakes) for u in units],
                )
            )
        final_act: SnakeBeta = layers[-2]
        self._final_act = snakes[id(final_act)]
        self._final = _conv(layers[-1])

    def run(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = x
        for lin, bias, cout, dw, block in self._upsample:
            h = F.linear(h, lin, bias).view(b, -1, cout)
            y = self._causal_conv(dw, self._with_history(dw, h, slots), bias=True)
            y = block.pwconv2(block.act(block.pwconv1(block.norm(y))))
            h = h + block.gamma * y
        # `pending` bias / residual are added by the next SnakeBeta pass, never on their own.
        z = self._causal_conv(self._first, self._with_history(self._first, h, slots), bias=False)
        if self.fused:
            full = self._blocks_fused(z, slots)
        else:
            pending_bias, residual = self._first.bias, None
            for blk in self._blocks:
                paired = self._paired(blk, z, slots, pending_bias, residual)
                z = F.linear(paired, blk.weight, blk.bias).view(b, -1, blk.weight.shape[0] // blk.stride)
                z, pending_bias, residual = self._units(blk.units, z, slots)
            full, _ = self._snake_into(self._final, z, slots, self._final_act, pending_bias, residual, False)
        out = self._causal_conv(self._final, full, bias=True)
        return out.clamp(min=-1.0, max=1.0).reshape(b, n * self.samples_per_frame).float()

    def _units(
        self, units: list[_Unit], z: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The residual units; returns (z, bias, residual) whose sum is their output."""
        pending_bias, residual = None, None
        for unit in units:
            full, z = self._snake_into(unit.conv1, z, slots, unit.act1, pending_bias, residual)
            y = self._causal_conv(unit.conv1, full, bias=False)
            g, _ = snake_nwc(y, y[:, :0], *unit.act2, bias=unit.conv1.bias, use_triton=self.use_triton)
            residual, z = z, F.linear(g, unit.w2)
            pending_bias = unit.b2
        return z, pending_bias, residual

    def _paired(
        self,
        blk: _Block,
        z: torch.Tensor,
        slots: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """The block's transposed-conv input rows (act[t-1], act[t]); writes its history back."""
        hist = self.pool.buffers[blk.key]
        paired = snake_nwc_paired(
            z, hist.index_select(0, slots), *blk.act, bias=bias, residual=residual, use_triton=self.use_triton
        )
        hist.index_copy_(0, slots, paired[:, -1:, z.shape[2] :])
        return paired

    def _blocks_fused(self, z: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The decoder blocks with fused residual units; returns the final conv's input."""
        b = z.shape[0]
        paired = self._paired(self._blocks[0], z, slots, self._first.bias, None)
        for i, blk in enumerate(self._blocks):
            x = F.linear(paired, blk.weight, blk.bias).view(b, -1, blk.weight.shape[0] // blk.stride)
            nxt = self._blocks[i + 1] if i + 1 < len(self._blocks) else None
            paired = self._units_fused(blk.units, x, slots, nxt)
        return paired  # after the last block: the final conv's input, history first

    def _units_fused(
        self, units: list[_Unit], x: torch.Tensor, slots: torch.Tensor, nxt: _Block | None
    ) -> torch.Tensor:
        """A block's residual units, each a dilated conv and one `snake_gemm` pass whose epilogue
        writes the next consumer's input: the next unit's conv, the next block's transposed conv
        (paired rows) or, after the last block, the final conv."""
        full, _ = self._snake_into(units[0].conv1, x, slots, units[0].act1, None, None, False)
        for i, unit in enumerate(units):
            y = self._causal_conv(unit.conv1, full, bias=False)
            last = i + 1 == len(units)
            if not last:
                key, act, keep = units[i + 1].conv1.key, units[i + 1].act1, units[i + 1].conv1.history
            elif nxt is not None:
                key, act, keep = nxt.key, nxt.act, 1
            else:
                key, act, keep = self._final.key, self._final_act, self._final.history
            buf = self.pool.buffers[key]
            paired = last and nxt is not None
            x, full = snake_gemm(
                y,
                unit.conv1.bias,
                unit.act2,
                unit.w2t,
                unit.b2,
                x,
                act,
                buf.index_select(0, slots),
                paired=paired,
                want_x=not last,
                use_triton=self.use_triton,
            )
            tail = full[:, -1:, full.shape[2] // 2 :] if paired else full[:, full.shape[1] - keep :]
            buf.index_copy_(0, slots, tail)
        return full

    def _snake_into(
        self,
        conv: _Conv,
        x: torch.Tensor,
        slots: torch.Tensor,
        act: tuple[torch.Tensor, torch.Tensor],
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        want_sum: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cat(history, snake(v)), v) with v = x + bias + residual; writes the new history back."""
        want_sum = want_sum and (bias is not None or residual is not None)  # else v is x itself
        buf = self.pool.buffers[conv.key]
        full, total = snake_nwc(
            x,
            buf.index_select(0, slots),
            *act,
            bias=bias,
            residual=residual,
            want_sum=want_sum,
            use_triton=self.use_triton,
        )
        buf.index_copy_(0, slots, full[:, full.shape[1] - conv.history :])
        return full, (x if total is None else total)

    def _with_history(self, conv: _Conv, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        buf = self.pool.buffers[conv.key]
        full = torch.cat([buf.index_select(0, slots), x], dim=1)
        buf.index_copy_(0, slots, full[:, full.shape[1] - conv.history :])
        return full

    @staticmethod
    def _causal_conv(conv: _Conv, full: torch.Tensor, bias: bool) -> torch.Tensor:
        """[B, h + T, Cin] (history first) -> [B, T, Cout] through an NHWC conv2d."""
        x4 = full.transpose(1, 2).unsqueeze(2)  # [B, Cin, 1, L], channels-last strides
        y = F.conv2d(
            x4, conv.weight, conv.bias if bias else None, dilation=(1, conv.dilation), groups=conv.groups
        )
        return y.squeeze(2).transpose(1, 2).contiguous()
