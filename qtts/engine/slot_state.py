"""Per-slot state of the talker runner: the packed columns and the eager bookkeeping copies.

`SlotStateMixin` is part of `ModelRunner`: it loads a started sequence's decode state into its slot,
moves slots when the dense slot table compacts, copies prompt-prefix KV in and out of the prefix
cache, and appends text that arrives for a running stream. All of it runs eagerly between graph
replays. The column indices below name the packed per-slot integer / float state.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import KVMove

# Columns of the packed per-slot integer / float state.
I_POS, I_FRAME, I_SEED, I_TOPK, I_PTOPK, I_GREEDY, I_PGREEDY, I_MINF, I_TLEN = range(9)
NUM_I = 9
F_TEMP, F_TOPP, F_REP, F_PTEMP, F_PTOPP = range(5)
NUM_F = 5


class SlotStateMixin:
    """The per-slot bookkeeping of `ModelRunner` (its KV cache and state buffers)."""

    def apply_moves(self, moves: Seq[KVMove]) -> None:
        if not moves:
            return
        for m in moves:
            n = m.num_positions
            if n > 0:
                self.k_cache[:, m.dst, :, :n] = self.k_cache[:, m.src, :, :n]
                self.v_cache[:, m.dst, :, :n] = self.v_cache[:, m.src, :, :n]
        src = torch.tensor([m.src for m in moves], device=self.device)
        dst = torch.tensor([m.dst for m in moves], device=self.device)
        for buf in (self.next_embed, self.trailing, self.seen, self.slot_ints, self.slot_floats):
            buf[dst] = buf[src]

    def load_prefixes(self, seqs: Seq[Sequence]) -> None:
        """Copy cached prompt-prefix KV into the slots of sequences admitted with a hit."""
        for seq in seqs:
            k, v = self.prefix_cache.get(seq.prefix_key)
            n = seq.num_prefilled
            self.k_cache[:, seq.slot, :, :n] = k[:, :, :n]
            self.v_cache[:, seq.slot, :, :n] = v[:, :, :n]

    def store_prefix(self, seq: Sequence) -> None:
        """Keep the slot's first `prefix_len` positions under the sequence's prefix key."""
        n = seq.prefix_len
        k = self.k_cache[:, seq.slot, :, :n].clone()
        v = self.v_cache[:, seq.slot, :, :n].clone()
        self.prefix_cache.put(seq.prefix_key, k, v)

    def start(self, seqs: Seq[Sequence]) -> None:
        """Load the decode state of sequences whose prompt is now in KV."""
        if not seqs:
            return
        ints, floats = [], []
        for seq in seqs:
            sp, pr = seq.sampling, seq.prompt
            n_trail = int(pr.trailing.shape[0]) if pr.trailing is not None else 0
            if n_trail > self.cfg.max_trailing:
                raise ValueError(
                    f"{n_trail} trailing text positions exceed max_trailing={self.cfg.max_trailing}"
                )
            ints.append(
                [
                    seq.num_prefill_positions,
                    0,
                    seq.seed,
                    sp.top_k,
                    sp.subtalker_top_k,
                    int(sp.greedy),
                    int(sp.predictor_greedy),
                    sp.min_new_tokens,
                    n_trail,
                ]
            )
            floats.append(
                [
                    sp.temperature,
                    sp.top_p,
                    sp.repetition_penalty,
                    sp.subtalker_temperature,
                    sp.subtalker_top_p,
                ]
            )
            slot = seq.slot
            self.next_embed[slot] = pr.embeds[-1].to(self.device, self.dtype)
            if n_trail:
                self.trailing[slot, :n_trail] = pr.trailing.to(self.device, self.dtype)
            self.trailing[slot, n_trail] = pr.pad_embed.reshape(-1).to(self.device, self.dtype)
        idx = torch.tensor([s.slot for s in seqs], device=self.device)
        self.slot_ints[idx] = torch.tensor(ints, dtype=torch.long).to(self.device)
        self.slot_floats[idx] = torch.tensor(floats, dtype=torch.float32).to(self.device)
        self.seen[idx] = False

    def append_trailing(self, slot: int, start: int, embeds: torch.Tensor, pad_embed: torch.Tensor) -> None:
        """Text that arrived for a running stream: trailing positions [start, start + k) of its
        slot, `tts_pad` after them, and the row's trailing length (eager copies between replays)."""
        end = start + int(embeds.shape[0])
        self.trailing[slot, start:end] = embeds.to(self.device, self.dtype)
        self.trailing[slot, end] = pad_embed.reshape(-1).to(self.device, self.dtype)
        self.slot_ints[slot, I_TLEN] = end
