"""Fused SnakeBeta: the torch fallback (and the Triton kernel where CUDA exists) vs the formula."""

from __future__ import annotations

import pytest
import torch

from qtts.decode_engine.snakebeta import (
    bias_add,
    snake,
    snake_after_history,
    snake_factors,
    snake_reference,
)
from qtts.model.codec_decoder import SnakeBeta

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _params(c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(c, generator=g), 0.5 * torch.randn(c, generator=g)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_the_reference_formula_and_the_model_module(device):
    alpha_log, beta_log = _params(6, 0)
    x = 3 * torch.randn(2, 6, 1000, generator=torch.Generator().manual_seed(1))
    want = snake_reference(x, alpha_log, beta_log)
    mod = SnakeBeta(6)
    with torch.no_grad():
        mod.alpha.copy_(alpha_log)
        mod.beta.copy_(beta_log)
    torch.testing.assert_close(mod(x).detach(), want, atol=1e-6, rtol=0)
    alpha, inv_beta = snake_factors(alpha_log.to(device), beta_log.to(device))
    got = snake(x.to(device), alpha, inv_beta).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The activation is not the identity on this input (the check above can fail).
    assert (want - x).abs().max() > 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_writes_after_the_history_like_cat(device):
    alpha_log, beta_log = _params(4, 2)
    x = torch.randn(3, 4, 37)
    hist = torch.randn(3, 4, 54)
    alpha, inv_beta = snake_factors(alpha_log.to(device), beta_log.to(device))
    got = snake_after_history(x.to(device), hist.to(device), alpha, inv_beta).cpu()
    want = torch.cat([hist, snake_reference(x, alpha_log, beta_log)], dim=2)
    assert got.shape == (3, 4, 91)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_input_is_computed_in_float32_and_stored_in_bf16(device):
    alpha_log, beta_log = _params(5, 3)
    x = torch.randn(2, 5, 300).to(torch.bfloat16)
    alpha, inv_beta = snake_factors(alpha_log.to(device), beta_log.to(device))
    got = snake(x.to(device), alpha, inv_beta).cpu()
    assert got.dtype == torch.bfloat16
    want = snake_reference(x.float(), alpha_log, beta_log)
    # One bf16 rounding of the result: relative error <= 2^-8.
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("device", DEVICES)
def test_conv_bias_folded_into_snake_and_residual_add(device):
    alpha_log, beta_log = _params(4, 4)
    g = torch.Generator().manual_seed(5)
    x, res, bias = (
        torch.randn(2, 4, 50, generator=g),
        torch.randn(2, 4, 40, generator=g),
        torch.randn(4, generator=g),
    )
    alpha, inv_beta = snake_factors(alpha_log.to(device), beta_log.to(device))
    biased = x + bias[None, :, None]
    got = snake(x.to(device), alpha, inv_beta, bias.to(device)).cpu()
    torch.testing.assert_close(got, snake_reference(biased, alpha_log, beta_log), atol=1e-5, rtol=1e-5)
    hist = torch.randn(2, 4, 6, generator=g)
    got = snake_after_history(x.to(device), hist.to(device), alpha, inv_beta, bias.to(device)).cpu()
    torch.testing.assert_close(got, torch.cat([hist, snake_reference(biased, alpha_log, beta_log)], 2))
    # A time slice (a transposed conv's trimmed output): bias, contiguous copy and residual in one.
    sliced = x.to(device)[..., 3:43]
    got = bias_add(sliced, bias.to(device), residual=res.to(device))
    assert got.is_contiguous()
    torch.testing.assert_close(got.cpu(), x[..., 3:43] + bias[None, :, None] + res)
    torch.testing.assert_close(bias_add(sliced, bias.to(device)).cpu(), x[..., 3:43] + bias[None, :, None])
