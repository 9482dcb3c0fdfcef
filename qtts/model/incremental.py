"""Stateful incremental decoding: each stream's decoder history is carried between chunks, so no
frame is ever decoded twice, and any number of streams with different chunk sizes share one batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from qtts.model.codec_decoder import CodecDecoder

_ids = itertools.count()


@dataclass(eq=False)
class DecoderState:
    """One stream's decoder history: batch-first tensors (batch 1) keyed by layer, plus counters.

    `frames` counts every frame decoded so far (the ICL prefix included): it is the position of
    the next frame in the sliding-window transformer. `prefix_frames` is the reference prefix length
    whose audio was never returned."""

    cache: dict[str, torch.Tensor]
    frames: int = 0
    prefix_frames: int = 0
    freed: bool = False
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def output_frames(self) -> int:
        """Frames whose audio has been returned."""
        return self.frames - self.prefix_frames

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cache.values())


class IncrementalDecoder:
    """Chunked decoding whose concatenated output equals one full decode of prefix + frames with the
    prefix samples cut. States are independent; `decode_batch` runs many of them in one forward."""

    def __init__(self, decoder: CodecDecoder):
        self.decoder = decoder
        self.samples_per_frame = decoder.samples_per_frame
        self.num_quantizers = decoder.cfg.num_quantizers

    def start(self, prefix_codes: torch.Tensor | None = None) -> DecoderState:
        """New stream; an ICL reference prefix [P, Q] is decoded now as context and never returned."""
        state = DecoderState(cache=self.decoder.empty_cache(1))
        if prefix_codes is not None and prefix_codes.shape[0] > 0:
            prefix = self._check_codes(prefix_codes)
            self._run([state], [prefix])
            state.prefix_frames = state.frames
        return state

    def decode(self, state: DecoderState, codes: torch.Tensor) -> torch.Tensor:
        """Decode the next frames [n, Q] of one stream -> their samples [n * samples_per_frame]."""
        return self.decode_batch([state], [codes])[0]

    def decode_batch(self, states: list[DecoderState], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode the next frames of many streams at once; row i of the result belongs to states[i].

        Rows may have different lengths, including zero (that row's state is left untouched and an
        empty tensor is returned for it)."""
        if len(states) != len(codes):
            raise ValueError(f"{len(states)} states but {len(codes)} code chunks")
        if len({s.id for s in states}) != len(states):
            raise ValueError("a decoder state appears twice in one batch")
        checked = [self._check_codes(c) for c in codes]
        for s in states:
            if s.freed:
                raise ValueError("decoder state was freed")
        live = [i for i, c in enumerate(checked) if c.shape[0] > 0]
        outputs: list[torch.Tensor] = [
            torch.zeros(0, device=self.decoder.device, dtype=self.decoder.dtype) for _ in states
        ]
        if live:
            decoded = self._run([states[i] for i in live], [checked[i] for i in live])
            for i, wav in zip(live, decoded, strict=True):
                outputs[i] = wav
        return outputs

    def free(self, state: DecoderState) -> None:
        """Drop the stream's history; the state cannot be used again."""
        state.cache.clear()
        state.freed = True

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [n, {self.num_quantizers}], got {tuple(codes.shape)}")
        return codes.to(device=self.decoder.device, dtype=torch.long)

    @torch.inference_mode()
    def _run(self, states: list[DecoderState], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode non-empty chunks of distinct states in one right-padded batch and write back."""
        dev = self.decoder.device
        lengths = [c.shape[0] for c in codes]
        longest = max(lengths)
        batch = torch.zeros(len(codes), longest, self.num_quantizers, dtype=torch.long, device=dev)
        for row, c in enumerate(codes):
            batch[row, : c.shape[0]] = c
        if len(states) == 1:
            cache = dict(states[0].cache)
        else:
            cache = {k: torch.cat([s.cache[k] for s in states], dim=0) for k in states[0].cache}
        positions = torch.tensor([s.frames for s in states], dtype=torch.long, device=dev)
        lens = torch.tensor(lengths, dtype=torch.long, device=dev)
        wav = self.decoder.forward_stream(batch, cache, positions, lens)
        out = []
        spf = self.samples_per_frame
        for row, (state, n) in enumerate(zip(states, lengths, strict=True)):
            # Trim by this row's own length: rows are never shifted against each other.
            out.append(wav[row, : n * spf])
            if len(states) == 1:
                state.cache = cache
            else:
                # Clone so a stream's history does not pin the whole batch's tensors.
                state.cache = {k: v[row : row + 1].clone() for k, v in cache.items()}
            state.frames += n
        return out
