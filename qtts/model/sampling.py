"""Per-request sampling with the official Qwen3-TTS rules.

Codebook 0 (talker): repetition penalty over the codebook-0 tokens generated so far, EOS masked
for the first `min_new_tokens` (2) steps, the top 1024 codec ids (2048..3071) suppressed except EOS,
then temperature, top-k, top-p (the order of Hugging Face's logits processors, which the official
package runs). Codebooks 1..15 (predictor): temperature, top-k, top-p, no penalty, nothing masked.
Greedy takes the argmax after the same processing (the repetition penalty and the masks still apply,
as in HF `generate(do_sample=False)`). A seed makes a request reproducible through its own
`torch.Generator`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Talker (codebook 0) and predictor (codebooks 1..15) sampling settings of one request."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    seed: int | None = None
    greedy: bool = False
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_greedy: bool | None = None  # None: same as `greedy`
    min_new_tokens: int = 2  # EOS is masked while fewer codebook-0 tokens were generated

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any]) -> SamplingParams:
        """Defaults from `generation_config.json` (keys as in the official package)."""
        d = cls()
        return replace(
            d,
            temperature=float(gen.get("temperature", d.temperature)),
            top_k=int(gen.get("top_k", d.top_k)),
            top_p=float(gen.get("top_p", d.top_p)),
            repetition_penalty=float(gen.get("repetition_penalty", d.repetition_penalty)),
            greedy=not bool(gen.get("do_sample", True)),
            subtalker_temperature=float(gen.get("subtalker_temperature", d.subtalker_temperature)),
            subtalker_top_k=int(gen.get("subtalker_top_k", d.subtalker_top_k)),
            subtalker_top_p=float(gen.get("subtalker_top_p", d.subtalker_top_p)),
            subtalker_greedy=not bool(gen.get("subtalker_dosample", True)),
        )

    @property
    def predictor_greedy(self) -> bool:
        return self.greedy if self.subtalker_greedy is None else self.subtalker_greedy

    def validate(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError("temperature must be > 0 (or use greedy)")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def _pick(logits: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> int:
    if greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float(), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose_codebook0(
    logits: torch.Tensor,
    params: SamplingParams,
    history: torch.Tensor | None,
    num_generated: int,
    eos_id: int,
    suppress_mask: torch.Tensor,
    generator: torch.Generator | None,
) -> int:
    """Pick codebook 0 from one row of talker logits [V] (float32 processing)."""
    scores = logits.float().clone()
    if params.repetition_penalty != 1.0 and history is not None and history.numel() > 0:
        prev = scores.gather(0, history)
        prev = torch.where(prev < 0, prev * params.repetition_penalty, prev / params.repetition_penalty)
        scores.scatter_(0, history, prev)
    if num_generated < params.min_new_tokens:
        scores[eos_id] = float("-inf")
    scores = scores.masked_fill(suppress_mask, float("-inf"))
    if not params.greedy:
        scores = _warp(scores, params.temperature, params.top_k, params.top_p)
    return _pick(scores, params.greedy, generator)


def choose_residual_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Codebook-1..15 codes for a batch of rows: logits [B, V] → LongTensor [B] on the same device.

    Rows with the same settings are warped together and nothing waits on the device (no `.item()`);
    each sampled row still draws from its own generator, so the result equals `choose_residual`
    row by row."""
    scores = logits.float()
    if all(p.predictor_greedy for p in params):
        return torch.argmax(scores, dim=-1)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        key = (
            (True,)
            if p.predictor_greedy
            else (False, p.subtalker_temperature, p.subtalker_top_k, p.subtalker_top_p)
        )
        groups.setdefault(key, []).append(i)
    picks: list[torch.Tensor | None] = [None] * len(params)
    for key, rows in groups.items():
        sub = scores[rows]
        if key[0]:
            chosen = torch.argmax(sub, dim=-1)
            for j, i in enumerate(rows):
                picks[i] = chosen[j]
            continue
        probs = torch.softmax(_warp(sub, key[1], key[2], key[3]), dim=-1)
        for j, i in enumerate(rows):
            picks[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return torch.stack(picks)


def choose_residual(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick a codebook-1..15 code from one row of predictor logits [V]."""
    scores = logits.float()
    greedy = params.predictor_greedy
    if not greedy:
        scores = _warp(scores, params.subtalker_temperature, params.subtalker_top_k, params.subtalker_top_p)
    return _pick(scores, greedy, generator)
