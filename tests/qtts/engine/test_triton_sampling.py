"""The sampling kernel (qtts.engine.triton_sampling) against the PyTorch reference sampler.sample_rows.

Without CUDA it runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which
is slow (tens of ms per row), so the batches here are small. The ids must equal the reference's
exactly: the thresholds are exact key comparisons, and only a float32 sum landing on a boundary
(different summation orders) could differ, which these seeds do not hit."""

from __future__ import annotations

import pytest
import torch

from qtts.engine import sampler

triton_sampling = pytest.importorskip("qtts.engine.triton_sampling")
if triton_sampling.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _settings(b: int, vocab: int, g: torch.Generator):
    pick = lambda options: torch.tensor(options)[torch.randint(0, len(options), (b,), generator=g)]  # noqa: E731
    temperature = pick([0.7, 1.0, 1.3]).float()
    top_k = pick([0, 1, 5, vocab + 3]).long()
    top_p = pick([1.0, 0.9, 0.3]).float()
    greedy = torch.rand(b, generator=g) < 0.2
    return temperature, top_k, top_p, greedy


@pytest.mark.parametrize(
    ("dtype", "vocab", "batch"),
    [
        (torch.float32, 16, 17),
        (torch.bfloat16, 16, 3),
        (torch.float32, 48, 3),
        (torch.bfloat16, 48, 17),
        (torch.float32, 2048, 3),
        (torch.bfloat16, 2048, 17),
        (torch.bfloat16, 2048, 1),
    ],
)
def test_kernel_equals_reference(dtype, vocab, batch):
    g = torch.Generator().manual_seed(vocab * 100 + batch)
    # bf16 logits tie often (8-bit mantissa): the top-k / top-p threshold ties must agree too.
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)
    if batch > 1:
        logits[1, : vocab // 2] = float("-inf")  # as codebook 0's masks
    temperature, top_k, top_p, greedy = _settings(batch, vocab, g)
    seed = torch.randint(0, 2**62, (batch,), generator=g)
    frame = torch.randint(0, 5000, (batch,), generator=g)
    codebook = batch % 16
    got, u = triton_sampling.sample(
        logits.to(DEVICE),
        temperature.to(DEVICE),
        top_k.to(DEVICE),
        top_p.to(DEVICE),
        greedy.to(DEVICE),
        seed.to(DEVICE),
        frame.to(DEVICE),
        codebook,
        return_uniform=True,
    )
    want_u = sampler.counter_uniform(seed, frame, torch.full_like(seed, codebook))
    assert torch.equal(u.cpu(), want_u)
    want = sampler.sample_rows(logits, temperature, top_k, top_p, greedy, want_u)
    assert torch.equal(got.cpu(), want)
    assert not torch.isinf(logits.float().gather(1, want[:, None])).any()


def test_in_kernel_uniform_is_counter_uniform_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    n = 24
    seed = torch.cat(
        [
            torch.tensor([0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, 0x123456789ABCDEF]),
            torch.randint(0, 2**63 - 1, (n - 7,), generator=g),
        ]
    )
    frame = torch.cat([torch.tensor([0, 1, 2**32 + 3]), torch.randint(0, 2**40, (n - 3,), generator=g)])
    logits = torch.zeros(n, 4)
    ones = torch.ones(n)
    greedy = torch.ones(n, dtype=torch.bool)  # the cheapest path: only the uniform matters here
    for codebook in (0, 1, 7, 15):
        _, u = triton_sampling.sample(
            logits.to(DEVICE),
            ones.to(DEVICE),
            torch.zeros(n, dtype=torch.long, device=DEVICE),
            ones.to(DEVICE),
            greedy.to(DEVICE),
            seed.to(DEVICE),
            frame.to(DEVICE),
            codebook,
            return_uniform=True,
        )
        assert torch.equal(u.cpu(), sampler.counter_uniform(seed, frame, torch.full_like(seed, codebook))), (
            codebook
        )


def test_given_uniform_strided_columns_and_integer_greedy():
    """Per-row settings as columns of state matrices (as the runner keeps them), a row stride
    wider than the vocabulary, and the index-order draw at the ends of [0, 1)."""
    g = torch.Generator().manual_seed(7)
    b, vocab = 6, 40
    wide = torch.randn(b, vocab + 8, generator=g).to(torch.bfloat16)
    logits = wide[:, :vocab]
    ints = torch.zeros(b, 3, dtype=torch.long)
    ints[:, 0] = torch.tensor([0, 5, 5, 1, 0, 3])  # top_k
    ints[:, 1] = torch.tensor([0, 0, 0, 0, 1, 0])  # greedy
    floats = torch.ones(b, 2)
    floats[:, 0] = torch.tensor([0.9, 1.0, 1.0, 1.2, 1.0, 0.5])  # temperature
    floats[:, 1] = torch.tensor([0.5, 1.0, 1.0, 1.0, 1.0, 0.8])  # top_p
    u = torch.tensor([0.0, 0.0, 1.0 - 2.0**-24, 0.37, 0.6, 0.99])
    got = triton_sampling.sample(
        logits.to(DEVICE),
        floats[:, 0].to(DEVICE),
        ints[:, 0].to(DEVICE),
        floats[:, 1].to(DEVICE),
        ints[:, 1].to(DEVICE),
        None,
        None,
        0,
        uniform=u.to(DEVICE),
    )
    want = sampler.sample_rows(logits, floats[:, 0], ints[:, 0], floats[:, 1], ints[:, 1].bool(), u)
    assert torch.equal(got.cpu(), want)
    kept = [logits[r].float().topk(5).indices for r in (1, 2)]  # (these rows have no tie at the 5th)
    assert want[1].item() == kept[0].min().item() and want[2].item() == kept[1].max().item()
    assert want[4].item() == logits[4].float().argmax().item()


def test_ties_at_the_threshold_and_single_finite_ids():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0, 2.0, 1.0, 2.0, 0.0, 1.0, 2.0]]).repeat(4, 1)
    logits[3] = float("-inf")
    logits[3, 9] = -5.0
    temperature = torch.ones(4)
    top_k = torch.tensor([3, 3, 1, 2])
    top_p = torch.tensor([1.0, 0.2, 1.0, 0.3])
    greedy = torch.zeros(4, dtype=torch.bool)
    u = torch.tensor([1.0 - 2.0**-24, 1.0 - 2.0**-24, 1.0 - 2.0**-24, 0.5])
    got = triton_sampling.sample(
        logits.to(DEVICE),
        temperature.to(DEVICE),
        top_k.to(DEVICE),
        top_p.to(DEVICE),
        greedy.to(DEVICE),
        None,
        None,
        0,
        uniform=u.to(DEVICE),
    )
    # k=3: the 3rd largest is 2.0, held by ids 2, 4, 6, 8, 11; all stay, so u -> 1 picks id 11.
    # top_p=0.2 keeps only the top group {1, 3}; k=1 keeps both 3.0 ids.
    assert got.cpu().tolist() == [11, 3, 3, 9]
    assert torch.equal(got.cpu(), sampler.sample_rows(logits, temperature, top_k, top_p, greedy, u))


def test_runner_frame_step_samples_the_same_codes_with_the_kernel(tiny_bundle):
    """The frame step with `sample_kernel='triton'` (no host uniforms) against the PyTorch
    reference sampler, for sampled rows with different settings, over a few frames."""
    if not triton_sampling.available(torch.device("cpu")):
        pytest.skip("the tiny model runs on the CPU: needs Triton's interpreter")
    from qtts.engine.model_runner import ModelRunner, RunnerConfig
    from qtts.engine.sequence import Sequence
    from qtts.engine.slot_scheduler import PrefillChunk
    from qtts.model import SamplingParams
    from tests.qtts.engine.tiny_talker import make_prompt

    params = [
        SamplingParams(seed=1),
        SamplingParams(temperature=1.3, top_k=0, top_p=0.8, subtalker_top_k=3, subtalker_top_p=0.9),
        SamplingParams(greedy=True),
    ]
    prompts = [make_prompt(tiny_bundle, n, 2, seed=900 + n) for n in (5, 9, 12)]
    runs = []
    for kernel in ("torch", "triton"):
        runner = ModelRunner(
            tiny_bundle, RunnerConfig(max_batch=4, max_len=64, max_trailing=8, sample_kernel=kernel)
        )
        assert (runner._sampling_kernels is not None) == (kernel == "triton")
        seqs = []
        for slot, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            seq = Sequence(f"s{slot}", p, sp, seed=1234 + slot, max_frames=6, cap_reason="length")
            seq.slot = slot
            seqs.append(seq)
        runner.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs])
        runner.start(seqs)
        runner.active[:3] = True
        codes = []
        for _ in range(3):
            runner._frame_step(3, 32)
            codes.append(runner.codes_out[:3].clone())
        runs.append(torch.stack(codes))
    assert torch.equal(runs[0], runs[1])
    assert len(set(runs[0][:, 0].flatten().tolist())) > 3  # the sampled rows did sample


def test_runner_rejects_the_kernel_with_a_candidate_cap(tiny_bundle):
    from qtts.engine.model_runner import RunnerConfig

    with pytest.raises(ValueError, match="max_candidates"):
        RunnerConfig(sample_kernel="triton", max_candidates=64)
    assert RunnerConfig(sample_kernel="auto", max_candidates=64).sample_kernel == "auto"
