"""Prefill of the talker runner: prompt chunks into their slots' KV.

Chunks run as one eager ragged batch through the bundle's decoder stack, or on the fast path
through the fused layer functions; chunks no wider than the largest prefill bucket go through
static-shape buffers at a (rows, width, fresh) bucket, replayed as CUDA graphs once captured.
With `RunnerConfig.prefill_packed` (the fast path's default) every call goes to the packed prefill
of `packed_prefill.py` instead. `PrefillMixin` is part of `ModelRunner`, whose KV cache, weights
and layer functions it uses.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

from qtts.engine.fused_layers import attend
from qtts.engine.packed_prefill import PackedPrefillMixin
from qtts.engine.slot_scheduler import PrefillChunk


class PrefillMixin(PackedPrefillMixin):
    """The prefill half of `ModelRunner` (its buffers, graphs and entry point `prefill`)."""

    def _init_prefill(self, config) -> None:
        """Prefill width and row buckets, their graphs and static input buffers (`config`: RunnerConfig),
        or the packed prefill's (`packed_prefill.py`)."""
        self.prefill_packed = self.fast_path if config.prefill_packed is None else config.prefill_packed
        if self.prefill_packed and not self.fast_path:
            raise ValueError("prefill_packed needs the fast path")
        self._init_packed_prefill(config)
        # Static-width prefill (fast path): inputs are copied into the buffers below and run at a
        # bucket width, as a CUDA graph once captured (eagerly on the CPU, for tests).
        self.prefill_buckets = (
            tuple(sorted({min(w, self.max_len) for w in config.prefill_buckets}))
            if self.fast_path and not self.prefill_packed
            else ()
        )
        self.prefill_rows = tuple(sorted(set(config.prefill_rows)))
        # Keyed (rows, width, fresh): a fresh batch starts every chunk at position 0, so its
        # attention needs only the chunk's own keys (causal SDPA, no gather of the slot's cache).
        self.prefill_graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        if self.prefill_buckets:
            r, w = self.prefill_rows[-1], self.prefill_buckets[-1]
            self.prefill_embeds = torch.zeros(r, w, self.hidden, device=self.device, dtype=self.dtype)
            self.prefill_positions = torch.full((r, w), self.scratch, device=self.device, dtype=torch.long)
            self.prefill_slots = torch.zeros(r, device=self.device, dtype=torch.long)

    @torch.inference_mode()
    def prefill(self, chunks: Seq[PrefillChunk]) -> None:
        """Write the KV of prompt positions [start, end) of every chunk, as one ragged batch."""
        chunks = [c for c in chunks if c.end > c.start]
        if not chunks:
            return
        if self.prefill_packed:
            self._prefill_packed(chunks)
            return
        width = max(c.end - c.start for c in chunks)
        if self.prefill_buckets and width <= self.prefill_buckets[-1]:
            self._prefill_bucketed(chunks)
            return
        x = torch.zeros(len(chunks), width, self.hidden, device=self.device, dtype=self.dtype)
        positions = torch.empty(len(chunks), width, dtype=torch.long)
        for r, c in enumerate(chunks):
            x[r, : c.end - c.start] = c.seq.prompt.embeds[c.start : c.end].to(self.device, self.dtype)
            positions[r] = torch.arange(c.start, c.start + width)
        # Padding tokens write columns the row overwrites before attending to them, or the scratch.
        positions = positions.clamp_(max=self.scratch).to(self.device)
        slots = torch.tensor([c.seq.slot for c in chunks], device=self.device)
        if not self.fast_path:
            self.talker.model(x, positions, slots, self.kv_view)
            return
        span = min(max(c.end for c in chunks), self.scratch)  # real tokens attend to columns < span
        self._prefill_fast(x, positions, slots, span, fresh=all(c.start == 0 for c in chunks))

    def _prefill_bucketed(self, chunks: Seq[PrefillChunk]) -> None:
        """Chunks grouped by the smallest width bucket that holds them and by whether they start
        at position 0, each group in batches of a row bucket, each batch through the
        (rows, width, fresh) graph (eagerly on the CPU)."""
        groups: dict[tuple[int, bool], list[PrefillChunk]] = {}
        for c in chunks:
            width = next(w for w in self.prefill_buckets if w >= c.end - c.start)
            groups.setdefault((width, c.start == 0), []).append(c)
        for (width, fresh), group in sorted(groups.items()):
            while group:
                rows = next((r for r in self.prefill_rows if r >= len(group)), self.prefill_rows[-1])
                batch, group = group[:rows], group[rows:]
                self._prefill_replay(batch, rows, width, fresh)

    def _prefill_replay(self, batch: Seq[PrefillChunk], rows: int, width: int, fresh: bool) -> None:
        """One batch at a static (rows, width): padding positions and padding rows write only the
        scratch column. A fresh batch attends causally within the chunk (padding comes after every
        real token); otherwise the graph attends over the whole slot (span max_len + 1) under the
        causal mask of the positions, so each token sees its own past only."""
        pos = torch.full((rows, width), self.scratch, dtype=torch.long)
        slots = torch.zeros(rows, dtype=torch.long)
        for r, c in enumerate(batch):
            t = c.end - c.start
            self.prefill_embeds[r, :t].copy_(c.seq.prompt.embeds[c.start : c.end].to(self.device, self.dtype))
            pos[r, :t] = torch.arange(c.start, c.end)
            slots[r] = c.seq.slot
        self.prefill_positions[:rows, :width].copy_(pos)
        self.prefill_slots[:rows].copy_(slots)
        graph = self.prefill_graphs.get((rows, width, fresh))
        if graph is not None:
            graph.replay()
        else:
            self._prefill_fast(
                self.prefill_embeds[:rows, :width],
                self.prefill_positions[:rows, :width],
                self.prefill_slots[:rows],
                self.scratch + 1,
                fresh,
            )

    def _capture_prefill(self, pool):
        """Capture one prefill graph per (rows, width, fresh), largest first, into `pool`; returns it."""
        self.prefill_positions.fill_(self.scratch)  # capture writes only scratch columns of slot 0
        self.prefill_slots.zero_()
        span = self.scratch + 1
        for rows in sorted(self.prefill_rows, reverse=True):
            for w in sorted(self.prefill_buckets, reverse=True):
                for fresh in (True, False):
                    args = (
                        self.prefill_embeds[:rows, :w],
                        self.prefill_positions[:rows, :w],
                        self.prefill_slots[:rows],
                        span,
                        fresh,
                    )
                    self._prefill_fast(*args)
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._prefill_fast(*args)
                    pool = pool if pool is not None else graph.pool()
                    self.prefill_graphs[(rows, w, fresh)] = graph
        return pool

    def _prefill_fast(
        self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, span: int, fresh: bool = False
    ) -> None:
        """The bundle's decoder stack with the fused layer functions (fewer launches per layer).
        `fresh`: every row's chunk starts at position 0 with its real tokens first, so attention
        runs causally over the chunk's own keys instead of gathering `span` columns of the slot."""
        model, d = self.talker.model, self.tdec
        r, t = positions.shape
        cos, sin = model.rotary(positions, self.dtype)
        mask = (
            None
            if fresh
            else (torch.arange(span, device=self.device)[None, None, :] <= positions[:, :, None])[:, None]
        )
        rows = slots[:, None].expand(r, t)
        for i in range(d.num_layers):
            w = self.talker_weights[i]
            q, k, v = self._qkv_fn(
                x,
                w.ln1,
                w.w_qkv,
                w.b_qkv,
                w.q_norm,
                w.k_norm,
                cos,
                sin,
                d.rms_norm_eps,
                d.num_heads,
                d.num_kv_heads,
            )
            self.k_cache[i][rows, :, positions] = k.transpose(1, 2).to(self.dtype)
            self.v_cache[i][rows, :, positions] = v.transpose(1, 2).to(self.dtype)
            if fresh:
                out = F.scaled_dot_product_attention(
                    q,
                    k.to(self.dtype),
                    v.to(self.dtype),
                    is_causal=True,
                    enable_gqa=d.num_heads != d.num_kv_heads,
                )
            else:
                keys, values = self.k_cache[i][slots, :, :span], self.v_cache[i][slots, :, :span]
                out = attend(q, keys, values, mask, "sdpa")
            x = self._out_fn(
                x,
                out.transpose(1, 2).reshape(r, t, -1),
                w.w_o,
                w.b_o,
                w.ln2,
                w.w_gate_up,
                w.w_down,
                d.rms_norm_eps,
            )
