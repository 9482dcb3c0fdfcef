"""The measured-out runner variants of benchmarks/runner_variants.py compute what serving computes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import talker_step
from benchmarks.runner_variants import attend_sdpa_grouped, serving_attention, variant_runner
from qtts.engine.fused_layers import attend
from qtts.engine.model_runner import I_GREEDY, I_PGREEDY, ModelRunner, RunnerConfig
from tests.benchmarks.test_talker_step import _tiny_bundle


def test_grouped_sdpa_equals_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 9, 8), torch.randn(3, 2, 9, 8)
    mask = torch.rand(3, 1, 1, 9) > 0.3
    mask[..., 0] = True
    assert torch.allclose(attend_sdpa_grouped(q, k, v, mask), attend(q, k, v, mask, "sdpa"), atol=1e-6)


def _one_frame(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    talker_step.fill_slots(runner, 10)
    runner.slot_ints[:, I_GREEDY] = 1
    runner.slot_ints[:, I_PGREEDY] = 1
    runner.active[:] = True
    runner._frame_step(4, 32)
    return runner.codes_out.clone(), runner.next_embed.clone()


@pytest.mark.parametrize(
    ("attention", "mode", "fast"), [("sdpa_grouped", "eager", False), ("matmul", "compile-nocarry", True)]
)
def test_variant_runner_matches_serving(attention, mode, fast):
    bundle = _tiny_bundle()
    cfg = RunnerConfig(
        max_len=32,
        max_batch=4,
        num_slots=4,
        max_trailing=8,
        talker_attention=serving_attention(attention),
        fast_path=fast,
        compile_layers=False,
        context_buckets=(32,),
    )
    variant = variant_runner(bundle, cfg, attention, mode)
    assert variant.grouped_sdpa == (attention == "sdpa_grouped") and variant.predictor_carry_kv == (
        mode == "eager"
    )
    codes, embeds = _one_frame(variant)
    want_codes, want_embeds = _one_frame(ModelRunner(bundle, cfg))
    assert torch.equal(codes, want_codes)
    assert torch.allclose(embeds, want_embeds, atol=1e-5)
