"""Seeded random weights for `--load-format dummy` and for tiny test snapshots.

Modules are built on the `meta` device (no memory, no init cost), then materialised with
`to_empty` on the target device and filled here: norms 1, biases 0, everything else N(0, std).
Non-persistent buffers (RoPE tables) are recomputed since `to_empty` leaves them uninitialised.
"""

from __future__ import annotations

import torch
from torch import nn

from qtts.model.layers import RMSNorm, RotaryEmbedding


def materialize(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Move a meta-device module to `device` (uninitialised storage) and rebuild RoPE buffers."""
    module = module.to_empty(device=device)
    module = module.to(dtype=dtype)
    reset_rotary(module)
    return module


def reset_rotary(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, RotaryEmbedding):
            dim = m.inv_freq.shape[0] * 2
            theta = m.theta
            inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            m.inv_freq = inv.to(m.inv_freq.device)


@torch.no_grad()
def init_dummy_weights(module: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Fill every parameter deterministically from `seed` (values drawn on the CPU in float32, or on
    the GPU when the module lives there, which is much faster for full-size models)."""
    first = next(module.parameters(), None)
    gen_device = first.device if first is not None and first.device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=gen_device)
    gen.manual_seed(seed)
    norm_params = set()
    for m in module.modules():
        if isinstance(m, RMSNorm | nn.LayerNorm | nn.BatchNorm1d):
            norm_params.update(id(p) for p in m.parameters(recurse=False))
    for name, p in module.named_parameters():
        if id(p) in norm_params:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            vals = torch.empty(p.shape, dtype=torch.float32, device=gen_device).normal_(
                0.0, std, generator=gen
            )
            p.copy_(vals.to(p.device, p.dtype))
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.reset_running_stats()  # storage from `to_empty` is garbage
    return module
