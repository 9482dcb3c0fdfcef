"""Batched, CUDA-graph-safe sampling of codec ids.

Every row carries its own temperature / top-k / top-p / repetition penalty / greedy flag as
tensors, so one captured graph serves any mix of requests. Randomness is counter based: the
uniform number that picks a row's token is a hash of (seed, frame index, codebook), so a
request's samples never depend on which other requests share its batch, on the batch bucket,
or on the order rows were admitted, and a seeded request replays exactly.

A token is drawn by inverse-CDF over the row's filtered distribution in vocabulary (index)
order, which needs one uniform per (row, codebook) instead of one per vocabulary entry
(Gumbel-max). Top-k and top-p are value thresholds (ties at a threshold are kept or dropped
together), so neither the filter nor the draw needs the distribution sorted: `sample_rows` here
is the PyTorch reference (it sorts, which is fine on the CPU), and
`qtts.engine.triton_sampling.sample` computes the same with one kernel per call and no sort.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_NEG_INF = float("-inf")
# What a row whose scores are broken (NaN, +inf, or no finite id) samples: never a valid id, so
# the engine fails that row alone (`model_runner` clamps it before any embedding lookup).
INVALID_ID = -1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow (split into 16-bit halves)."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32): every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: torch.Tensor, step: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) from int64 tensors (broadcast together); seed in [0, 2**63)."""
    h = _mix32(seed & _MASK32)
    h = _mix32(h ^ ((seed >> 32) & _MASK32))
    h = _mix32(h ^ (step & _MASK32))
    h = _mix32(h ^ (_mul32(codebook & _MASK32, 0x9E3779B9) + 1) & _MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def frame_uniforms(seed: torch.Tensor, frame_idx: torch.Tensor, num_codebooks: int) -> torch.Tensor:
    """[B, num_codebooks] uniforms for one frame of every row."""
    cb = torch.arange(num_codebooks, device=seed.device, dtype=torch.long)
    return counter_uniform(seed[:, None], frame_idx[:, None], cb[None, :])


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics over the set of ids already generated: positive logits / p, negative * p."""
    p = penalty[:, None].to(logits.dtype)
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def mask_codebook0(
    logits: torch.Tensor,
    suppressed: torch.Tensor,
    eos_mask: torch.Tensor,
    frame_idx: torch.Tensor,
    min_frames: int,
) -> torch.Tensor:
    """Suppress the control ids (bool [V]) and EOS (bool [V], one True) while frame_idx < min_frames."""
    logits = logits.masked_fill(suppressed[None, :], _NEG_INF)
    too_early = (frame_idx < min_frames)[:, None] & eos_mask[None, :]
    return logits.masked_fill(too_early, _NEG_INF)


def codebook0_logits(
    logits: torch.Tensor,
    seen: torch.Tensor,
    penalty: torch.Tensor,
    suppressed: torch.Tensor,
    eos_mask: torch.Tensor,
    frame_idx: torch.Tensor,
    min_frames: torch.Tensor,
) -> torch.Tensor:
    """Codebook-0 head output -> float32 logits with the repetition penalty and the masks applied
    (one function, so that torch.compile fuses the cast, penalty and masks into few kernels)."""
    logits = apply_repetition_penalty(logits.float(), seen, penalty)
    return mask_codebook0(logits, suppressed, eos_mask, frame_idx, min_frames)


def codebook0_masks(
    vocab_size: int, eos_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(suppressed, eos) bool [V] masks: the top 1024 ids except EOS are never sampled."""
    suppressed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    suppressed[max(0, vocab_size - 1024) :] = True
    suppressed[eos_id] = False
    eos = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    eos[eos_id] = True
    return suppressed, eos


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    uniform: torch.Tensor,
    max_candidates: int | None = None,
) -> torch.Tensor:
    """One id per row of float logits [B, V] (-inf ids are never sampled).

    A row whose scaled logits hold a NaN or +inf, or no finite value, gets `INVALID_ID` (greedy or
    not): one row's overflow (a temperature or penalty far outside the API's ranges, a broken
    prompt) fails only that row, never its neighbours.

    Greedy rows take the argmax of the logits (the first id on ties). The others, with
    s = logits / max(T, 1e-5):
      top-k: keep the ids with s >= the k-th largest s (ties counted with multiplicity; every id
        tied at the threshold stays; k <= 0 or k >= V: all);
      probs = softmax of s over the kept ids;
      top-p (p < 1): keep a kept id i iff S(i) < p, S(i) = the probs of kept ids with s strictly
        above s[i] (tie groups stay or go together; the top group always stays);
      draw: w = probs of the kept ids in vocabulary order, cdf = cumsum(w), the id is the number
        of ids with cdf <= uniform * sum(w); if that is V or an id with w == 0 (rounding), the
        last id with w > 0.

    `max_candidates` restricts the candidates to the row's `max_candidates` largest s (topk, ties
    at that cut broken arbitrarily) with the same rules among them; a row's top-k is then at most
    the cap. The Triton kernel (`triton_sampling.sample`) has no cap.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    num_cand = vocab if not max_candidates else min(vocab, max_candidates)
    greedy_ids = logits.argmax(dim=-1)
    t = torch.where(greedy, torch.ones_like(temperature), temperature).clamp_min(1e-5)
    scaled = logits / t[:, None]
    if num_cand == vocab:
        vals, idx = scaled.sort(dim=-1, descending=True)
    else:
        vals, idx = scaled.topk(num_cand, dim=-1)
    kept = _kept_probs(vals, top_k, top_p, num_cand)
    w = torch.zeros_like(scaled).scatter(1, idx, kept)
    sampled = _draw(w, uniform)
    broken = (scaled.isnan() | (scaled == float("inf"))).any(dim=-1) | ~(scaled > _NEG_INF).any(dim=-1)
    return torch.where(broken, INVALID_ID, torch.where(greedy, greedy_ids, sampled))


def _kept_probs(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_cand: int) -> torch.Tensor:
    """`sample_rows`' filter: the probs of the candidates `vals` (scaled logits [B, num_cand], in
    descending order) that top-k and top-p keep, 0 for the others, in the same order."""
    rank = torch.arange(num_cand, device=vals.device)
    k = torch.where((top_k <= 0) | (top_k > num_cand), torch.full_like(top_k, num_cand), top_k)
    keep = vals >= vals.gather(1, (k - 1)[:, None])
    e = torch.where(keep, torch.exp(vals - vals[:, :1]), 0.0)
    probs = e / e.sum(dim=-1, keepdim=True)
    # Top-p: S(i) is the exclusive cumulative mass at the first member of i's tie group.
    before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(dim=-1)[:, :-1]], dim=-1)
    new_group = torch.cat([torch.ones_like(keep[:, :1]), vals[:, 1:] != vals[:, :-1]], dim=-1)
    start = torch.where(new_group, rank, 0).cummax(dim=-1).values
    mass_above = before.gather(1, start)
    keep_p = (mass_above < top_p[:, None]) | (start == 0) | (top_p >= 1.0)[:, None]
    return torch.where(keep & keep_p, probs, 0.0)


def _draw(w: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`sample_rows`' inverse-CDF draw over the kept probs `w` [B, V] in vocabulary order: the
    number of ids with cdf <= uniform * sum(w), or the last id with w > 0 past the end or on a
    w == 0 id (rounding)."""
    vocab = w.shape[-1]
    cdf = w.cumsum(dim=-1)
    target = uniform * w.sum(dim=-1)
    choice = (cdf <= target[:, None]).sum(dim=-1)
    ids = torch.arange(vocab, device=w.device)
    last = torch.where(w > 0, ids, -1).amax(dim=-1)
    hit = w.gather(1, choice.clamp(max=vocab - 1)[:, None]).squeeze(1)
    return torch.where((choice >= vocab) | (hit == 0), last, choice)
