"""The conv stack of a decode step in the checkpoint's channels-first layout [B, C, T] (the
reference path): two upsampling rounds (transposed conv + ConvNeXt), conv + 4 SnakeBeta blocks,
conv, clamp. Each layer reads and writes its history in the `SlotPool` rows named by `slots`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtts.decode_engine.slots import SlotPool
from qtts.decode_engine.snakebeta import bias_add, snake, snake_after_history, snake_factors
from qtts.model.codec_decoder import CausalConv1d, CausalTransConv1d, CodecDecoder, ConvNeXtBlock, SnakeBeta


def snake_table(reference: CodecDecoder, model: CodecDecoder) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """SnakeBeta factors of `model`'s activations (by module id), from the fp32 `reference`'s
    parameters (the model copy has the same module order)."""
    return {
        id(mine): snake_factors(ref.alpha, ref.beta)
        for ref, mine in zip(reference.modules(), model.modules(), strict=True)
        if isinstance(mine, SnakeBeta)
    }


class ConvStack:
    """Transformer output [B, n, latent] -> clamped waveform [B, n * spf] float32, channels-first."""

    def __init__(self, model: CodecDecoder, reference: CodecDecoder, pool: SlotPool):
        self.model = model
        self.pool = pool
        self.samples_per_frame = model.samples_per_frame
        self._snake = snake_table(reference, model)

    def run(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        m = self.model
        b, n, _ = x.shape
        h = x.transpose(1, 2)
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


def _add_bias(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if bias is None:
        return x.contiguous() if residual is None else x + residual
    return bias_add(x, bias, residual)
