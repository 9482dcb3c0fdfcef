"""Batched GPU-style sampler: greedy, counter RNG, top-k / top-p, repetition penalty, EOS rules."""

from __future__ import annotations

import torch

from qtts.engine import sampler

EOS = 2150


def rows(n: int, temperature=1.0, top_k=0, top_p=1.0, greedy=False):
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), int(top_k), dtype=torch.long),
        torch.full((n,), float(top_p)),
        torch.full((n,), bool(greedy)),
    )


def draw(logits: torch.Tensor, seeds: torch.Tensor, **kw) -> torch.Tensor:
    n = logits.shape[0]
    u = sampler.counter_uniform(seeds, torch.zeros_like(seeds), torch.zeros_like(seeds))
    return sampler.sample_rows(logits, *rows(n, **kw), uniform=u)


def test_greedy_rows_take_argmax_mixed_with_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temp, top_k, top_p, _ = rows(6)
    greedy = torch.tensor([True, False, True, False, True, False])
    u = torch.rand(6)
    out = sampler.sample_rows(logits, temp, top_k, top_p, greedy, u)
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])


def test_counter_uniform_is_deterministic_spread_and_keyed_on_every_field():
    seed = torch.arange(4096, dtype=torch.long)
    u = sampler.counter_uniform(seed, torch.zeros_like(seed), torch.zeros_like(seed))
    assert torch.equal(u, sampler.counter_uniform(seed, torch.zeros_like(seed), torch.zeros_like(seed)))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02 and u.unique().numel() > 4000
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert float(hist.min()) > 300  # ~410 expected per bin
    big = torch.tensor([2**62 + 5], dtype=torch.long)
    base = sampler.counter_uniform(big, torch.tensor([3]), torch.tensor([1]))
    assert not torch.equal(base, sampler.counter_uniform(big + 1, torch.tensor([3]), torch.tensor([1])))
    assert not torch.equal(base, sampler.counter_uniform(big, torch.tensor([4]), torch.tensor([1])))
    assert not torch.equal(base, sampler.counter_uniform(big, torch.tensor([3]), torch.tensor([2])))


def test_samples_of_a_row_do_not_depend_on_its_batch_neighbours():
    torch.manual_seed(1)
    vocab = 64
    mine = torch.randn(1, vocab)
    seeds = torch.tensor([1234], dtype=torch.long)
    alone = [draw(mine, seeds, temperature=0.9, top_k=20).item()]
    for n in (2, 7, 33):
        others = torch.randn(n - 1, vocab)
        batch = torch.cat([others[: n // 2], mine, others[n // 2 :]])
        bseeds = torch.randint(0, 2**62, (n,))
        bseeds[n // 2] = 1234
        out = draw(batch, bseeds, temperature=0.9, top_k=20)
        alone.append(out[n // 2].item())
    assert len(set(alone)) == 1
    frames = sampler.frame_uniforms(torch.tensor([7, 1234, 9]), torch.tensor([5, 5, 5]), 16)
    assert torch.equal(frames[1], sampler.frame_uniforms(torch.tensor([1234]), torch.tensor([5]), 16)[0])


def test_top_k_only_draws_the_k_best_and_follows_the_distribution():
    vocab, n = 40, 4000
    logits = torch.linspace(0, 3, vocab).flip(0).expand(n, vocab).contiguous()
    out = draw(logits, torch.arange(n), top_k=5)
    assert set(out.tolist()) == {0, 1, 2, 3, 4}
    p = torch.softmax(logits[0, :5], -1)
    freq = torch.bincount(out, minlength=5)[:5].float() / n
    assert torch.allclose(freq, p, atol=0.03)


def test_top_p_keeps_the_ids_whose_mass_above_is_below_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(3000, 4).contiguous()
    out = draw(logits, torch.arange(3000), top_p=0.7)  # 0.5 < 0.7 <= 0.8: ids 0 and 1 stay
    assert set(out.tolist()) == {0, 1}
    freq1 = (out == 1).float().mean().item()
    assert abs(freq1 - 0.3 / 0.8) < 0.04
    full = draw(logits, torch.arange(3000), top_p=1.0)
    assert set(full.tolist()) == {0, 1, 2, 3}


def test_ties_at_the_top_k_threshold_are_all_kept():
    logits = torch.tensor([[3.0, 2.0, 0.0, 2.0, 1.0, 2.0]]).expand(3000, 6).contiguous()
    out = draw(logits, torch.arange(3000), top_k=2)  # the 2nd largest is 2.0, held by ids 1, 3, 5
    assert set(out.tolist()) == {0, 1, 3, 5}
    top1 = draw(logits, torch.arange(3000), top_k=1)
    assert set(top1.tolist()) == {0}


def test_top_p_keeps_or_drops_a_tie_group_together():
    logits = torch.log(torch.tensor([[0.2, 0.4, 0.2, 0.2]])).expand(3000, 4).contiguous()
    # Ids 0, 2, 3 tie with 0.4 above them: all stay when 0.4 < p, all go otherwise.
    assert set(draw(logits, torch.arange(3000), top_p=0.45).tolist()) == {0, 1, 2, 3}
    assert set(draw(logits, torch.arange(3000), top_p=0.35).tolist()) == {1}
    # The top group always stays, even when its own mass exceeds p.
    assert set(draw(logits, torch.arange(3000), top_p=0.01).tolist()) == {1}


def test_draw_walks_the_kept_ids_in_vocabulary_order():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 6.0, 2.0, 5.5]]).expand(3, 8).contiguous()
    temp, top_k, top_p, greedy = rows(3, top_k=3)  # kept: ids 1, 5, 7
    u = torch.tensor([0.0, 1.0 - 2.0**-24, 0.5])
    out = sampler.sample_rows(logits, temp, top_k, top_p, greedy, u)
    assert out[:2].tolist() == [1, 7]
    # Index-order CDF: [p1, p1 + p5, 1]; u = 0.5 lands in id 5's interval.
    p = torch.softmax(torch.tensor([5.0, 6.0, 5.5]), -1)
    assert p[0] < 0.5 < p[0] + p[1] and out[2].item() == 5


def test_minus_inf_ids_are_never_sampled():
    logits = torch.full((4, 10), float("-inf"))
    logits[:, 6] = -3.0
    logits[2:, 2] = 1.0
    seeds = torch.arange(4)
    u = torch.tensor([0.0, 0.999, 0.0, 0.999])
    for kw in ({}, {"top_k": 5}, {"top_p": 0.5}, {"greedy": True}):
        out = sampler.sample_rows(logits, *rows(4, **kw), uniform=u)
        assert out[:2].tolist() == [6, 6] and set(out[2:].tolist()) <= {2, 6}, kw
    assert draw(logits, seeds, top_p=1.0)[:2].tolist() == [6, 6]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]]).expand(4000, 2).contiguous()
    hot = (draw(logits, torch.arange(4000), temperature=1.0) == 0).float().mean().item()
    cold = (draw(logits, torch.arange(4000), temperature=0.25) == 0).float().mean().item()
    assert abs(hot - torch.sigmoid(torch.tensor(1.0)).item()) < 0.03
    assert abs(cold - torch.sigmoid(torch.tensor(4.0)).item()) < 0.03


def test_max_candidates_matches_full_sort_when_top_k_is_inside():
    torch.manual_seed(3)
    logits = torch.randn(64, 300)
    seeds = torch.arange(64)
    u = sampler.counter_uniform(seeds, torch.zeros_like(seeds), torch.zeros_like(seeds))
    args = rows(64, temperature=0.8, top_k=50)
    full = sampler.sample_rows(logits, *args, uniform=u)
    capped = sampler.sample_rows(logits, *args, uniform=u, max_candidates=64)
    assert torch.equal(full, capped)


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = sampler.apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, -1.0]]))
    # The penalty changes the greedy choice away from a repeated id.
    assert (
        sampler.apply_repetition_penalty(
            torch.tensor([[1.0, 0.9]]), torch.tensor([[True, False]]), torch.tensor([1.2])
        )
        .argmax()
        .item()
        == 1
    )


def test_codebook0_masks_suppress_control_ids_and_early_eos():
    suppressed, eos = sampler.codebook0_masks(3072, EOS)
    assert suppressed[2048:].sum().item() == 1023 and not suppressed[EOS] and not suppressed[:2048].any()
    assert eos.sum().item() == 1 and eos[EOS]
    logits = torch.zeros(3, 3072)
    logits[:, EOS] = 100.0
    logits[:, 3000] = 200.0
    frame = torch.tensor([0, 1, 2])
    masked = sampler.mask_codebook0(logits, suppressed, eos, frame, torch.tensor([2, 2, 2]))
    temp, top_k, top_p, greedy = rows(3, greedy=True)
    picks = sampler.sample_rows(masked, temp, top_k, top_p, greedy, torch.zeros(3))
    assert picks[2].item() == EOS
    assert picks[0].item() < 2048 and picks[1].item() < 2048
    assert torch.isinf(masked[:, 3000]).all()
