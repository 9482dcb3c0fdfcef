"""Packed prefill: the prompt chunks of one step as one token axis, one GEMM per linear per layer.

The per-row prefill (`prefill.py`) pads every chunk to a width bucket and runs the rows as a batch,
one graph per (rows, width); chunks of different widths or that continue a prompt go through
separate launch sequences, and a continuing chunk gathers its whole slot for a masked attention.
Here every chunk's positions are concatenated (no padding between chunks): each layer is one
q|k|v GEMM, the fused norm + RoPE + KV store, one varlen causal attention over the slots' own
keys (`triton_attention.prefill_attention`; a PyTorch loop per chunk where the Triton kernels do
not run), one o GEMM, one gate|up GEMM and one down GEMM over all N tokens. The last layer stops
after writing its K/V: nothing reads its attention or MLP output. On CUDA the call is a graph
replay at the smallest token bucket that holds it (padding tokens write the scratch column of
slot 0; `RunnerConfig.prefill_token_buckets`, up to 8,192 tokens by default), or an eager run
above the largest bucket (eager calls are host-bound: about ten Python launches a layer).

`PackedPrefillMixin` is part of `ModelRunner` (its caches, weights, layer functions and kernels).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from qtts.engine.fused_layers import attend, fp8_fused_kernels
from qtts.engine.slot_scheduler import PrefillChunk

# Chunks per packed call: the captured attention grid holds ceil(N / block_m) + this many blocks.
MAX_PACKED_CHUNKS = 64


def query_blocks(spans: Seq[tuple[int, int, int, int]], block_m: int) -> list[tuple[int, int, int, int]]:
    """(slot, first packed token, token count, first position) per chunk -> the same per query
    block of at most `block_m` tokens (what `prefill_attention` takes, one program each)."""
    out = []
    for slot, q0, count, p0 in spans:
        for off in range(0, count, block_m):
            out.append((slot, q0 + off, min(block_m, count - off), p0 + off))
    return out


def fused_prefill_layers(
    kernels, lin, x, weights, dcfg, k_cache, v_cache, rows, wpos, cos, sin, blocks, block_m: int
) -> None:
    """The talker's layers over packed tokens x [N, H] with the fused Triton kernels: token m
    writes its K/V at (rows[m], wpos[m]); attention by query blocks of at most `block_m` tokens
    (`blocks`). Writes KV only."""
    eps = dcfg.rms_norm_eps
    norm, silu_mul = fp8_fused_kernels(kernels, weights, x)
    delta = None
    last = len(weights) - 1
    for i, w in enumerate(weights):
        x, h = norm(x, delta, w.ln1, eps)
        q = kernels.qk_norm_rope_store(
            lin(h, w.w_qkv, w.b_qkv),
            w.q_norm,
            w.k_norm,
            cos,
            sin,
            k_cache[i],
            v_cache[i],
            rows,
            wpos,
            eps,
            dcfg.num_heads,
            dcfg.num_kv_heads,
        )
        if i == last:
            return
        attn = kernels.prefill_attention(q, k_cache[i], v_cache[i], blocks, block_m=block_m)
        x, h = norm(x, lin(attn, w.w_o, w.b_o), w.ln2, eps)
        delta = lin(silu_mul(lin(h, w.w_gate_up)), w.w_down)


def torch_prefill_layers(
    qkv_fn, out_fn, x, weights, dcfg, k_cache, v_cache, rows, wpos, cos, sin, spans
) -> None:
    """`fused_prefill_layers` with the fast path's PyTorch layer functions (no Triton): the
    same packed GEMMs, the KV written by index, attention per chunk over its slot's keys."""
    n = x.shape[0]
    x = x[None]  # [1, N, H]
    cos, sin = cos[None], sin[None]
    last = len(weights) - 1
    for i, w in enumerate(weights):
        q, k, v = qkv_fn(
            x,
            w.ln1,
            w.w_qkv,
            w.b_qkv,
            w.q_norm,
            w.k_norm,
            cos,
            sin,
            dcfg.rms_norm_eps,
            dcfg.num_heads,
            dcfg.num_kv_heads,
        )  # [1, heads, N, D]
        k_cache[i][rows, :, wpos] = k[0].transpose(0, 1).to(k_cache.dtype)
        v_cache[i][rows, :, wpos] = v[0].transpose(0, 1).to(v_cache.dtype)
        if i == last:
            return
        out = torch.zeros_like(q)
        for slot, q0, count, p0 in spans:
            keys, values = (
                k_cache[i][slot : slot + 1, :, : p0 + count],
                v_cache[i][slot : slot + 1, :, : p0 + count],
            )
            pos = torch.arange(p0, p0 + count, device=x.device)
            mask = (torch.arange(p0 + count, device=x.device)[None, :] <= pos[:, None])[None, None]
            out[:, :, q0 : q0 + count] = attend(q[:, :, q0 : q0 + count], keys, values, mask, "sdpa")
        x = out_fn(
            x,
            out.transpose(1, 2).reshape(1, n, -1),
            w.w_o,
            w.b_o,
            w.ln2,
            w.w_gate_up,
            w.w_down,
            dcfg.rms_norm_eps,
        )


class PackedPrefillMixin:
    """The packed prefill of `ModelRunner`: buffers, token-bucket graphs, entry `_prefill_packed`."""

    def _init_packed_prefill(self, config) -> None:
        """Static buffers for the largest token bucket (graphs captured later, CUDA only)."""
        self.packed_token_buckets = tuple(sorted(set(config.prefill_token_buckets)))
        self.packed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._packed_block_m = self._fused_kernels.prefill_block_m(self.dtype) if self.fused_decode else 0
        if self.prefill_packed and self.fused_decode and self.use_graphs and self.packed_token_buckets:
            self._alloc_packed_buffers()  # graphs replay the fused kernels only (the PyTorch path loops)

    def _alloc_packed_buffers(self) -> None:
        n = self.packed_token_buckets[-1]
        dev = self.device
        self.packed_x = torch.zeros(n, self.hidden, device=dev, dtype=self.dtype)
        self.packed_rows = torch.zeros(n, device=dev, dtype=torch.long)
        self.packed_pos = torch.full((n,), self.scratch, device=dev, dtype=torch.long)
        self.packed_blocks = torch.zeros(self._grid_blocks(n), 4, device=dev, dtype=torch.int32)

    def _grid_blocks(self, n_tokens: int) -> int:
        """Query blocks of a captured grid at `n_tokens`: every chunk may end in a partial block."""
        return -(-n_tokens // self._packed_block_m) + MAX_PACKED_CHUNKS

    def _prefill_packed(self, chunks: Seq[PrefillChunk]) -> None:
        """Chunks in packed calls of at most MAX_PACKED_CHUNKS chunks each (one call per step in
        practice)."""
        for i in range(0, len(chunks), MAX_PACKED_CHUNKS):
            self._packed_call(chunks[i : i + MAX_PACKED_CHUNKS])

    def _packed_call(self, chunks: Seq[PrefillChunk]) -> None:
        """One packed call: a graph replay at the smallest token bucket that holds the chunks, or
        an eager run (no graphs, or more tokens than the largest bucket)."""
        spans, q0 = [], 0
        for c in chunks:
            spans.append((c.seq.slot, q0, c.end - c.start, c.start))
            q0 += c.end - c.start
        embeds = torch.cat([c.seq.prompt.embeds[c.start : c.end].to(self.device, self.dtype) for c in chunks])
        rows = torch.cat([torch.full((c.end - c.start,), c.seq.slot, dtype=torch.long) for c in chunks])
        pos = torch.cat([torch.arange(c.start, c.end) for c in chunks])
        bucket = next((b for b in self.packed_token_buckets if b >= q0), None) if self.packed_graphs else None
        if bucket is None:
            blocks = None
            if self.fused_decode:
                blocks = torch.tensor(query_blocks(spans, self._packed_block_m), dtype=torch.int32).to(
                    self.device
                )
            self._packed_layers(embeds, rows.to(self.device), pos.to(self.device), blocks, spans)
            return
        self.packed_x[:q0].copy_(embeds)
        self.packed_rows[:q0].copy_(rows)
        self.packed_rows[q0:bucket].zero_()
        self.packed_pos[:q0].copy_(pos)
        self.packed_pos[q0:bucket].fill_(self.scratch)
        host = torch.zeros(self._grid_blocks(bucket), 4, dtype=torch.int32)
        qb = query_blocks(spans, self._packed_block_m)
        host[: len(qb)] = torch.tensor(qb, dtype=torch.int32)
        self.packed_blocks[: host.shape[0]].copy_(host)
        self.packed_graphs[bucket].replay()

    def _packed_layers(self, x, rows, pos, blocks, spans) -> None:
        """The layers over packed tokens x [N, H] at positions `pos` of slots `rows`."""
        model = self.talker.model
        cos, sin = model.rotary(pos, self.dtype)  # [N, D]
        # Token positions past the slot (graph padding) write the scratch column; RoPE of any
        # position is harmless there.
        if self.fused_decode:
            fused_prefill_layers(
                self._fused_kernels,
                self._linear,
                x,
                self.talker_weights,
                self.tdec,
                self.k_cache,
                self.v_cache,
                rows,
                pos,
                cos,
                sin,
                blocks,
                self._packed_block_m,
            )
        else:
            torch_prefill_layers(
                self._qkv_fn,
                self._out_fn,
                x,
                self.talker_weights,
                self.tdec,
                self.k_cache,
                self.v_cache,
                rows,
                pos,
                cos,
                sin,
                spans,
            )

    def _packed_graph_args(self, n: int) -> tuple:
        """`_packed_layers` arguments of the graph at token bucket n: views of the static buffers."""
        blocks = self.packed_blocks[: self._grid_blocks(n)]
        return self.packed_x[:n], self.packed_rows[:n], self.packed_pos[:n], blocks, None

    def _capture_packed(self, pool):
        """One graph per token bucket, largest first, into `pool` (the fused kernels only: the
        PyTorch fallback loops over chunks on the host). Writes only slot 0's scratch column."""
        if not (self.prefill_packed and self.fused_decode and self.use_graphs and self.packed_token_buckets):
            return pool
        self.packed_rows.zero_()
        self.packed_pos.fill_(self.scratch)
        self.packed_blocks.zero_()
        for n in sorted(self.packed_token_buckets, reverse=True):
            args = self._packed_graph_args(n)
            self._packed_layers(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._packed_layers(*args)
            pool = pool if pool is not None else graph.pool()
            self.packed_graphs[n] = graph
        return pool
