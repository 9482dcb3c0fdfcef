"""Stateful incremental decoding: each stream's decoder history is carried between chunks, so no
frame is ever decoded twice, and any number of streams with different chunk sizes share one batch.

Histories live in one slot pool per decoder (batch-first tensors of fixed shape, one row per
stream), so a batched step gathers its rows with one index_select per tensor and scatters them
back with one index_copy_, whatever the batch size; fixed shapes are what CUDA graphs need later.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from qtts.model.codec_decoder import CodecDecoder


@dataclass(eq=False)
class DecoderState:
    """One stream's handle: its row in the decoder's slot pool plus counters.

    `frames` counts every frame decoded so far (the ICL prefix included): it is the position of
    the next frame in the sliding-window transformer. `prefix_frames` is the reference prefix length
    whose audio was never returned."""

    slot: int
    frames: int = 0
    prefix_frames: int = 0
    freed: bool = False

    @property
    def output_frames(self) -> int:
        """Frames whose audio has been returned."""
        return self.frames - self.prefix_frames


class IncrementalDecoder:
    """Chunked decoding whose concatenated output equals one full decode of prefix + frames with the
    prefix samples cut. States are independent; `decode_batch` runs many of them in one forward.
    Thread-safe: one lock serialises the pool (a service may free a state from another thread)."""

    def __init__(self, decoder: CodecDecoder, initial_slots: int = 8):
        self.decoder = decoder
        self.samples_per_frame = decoder.samples_per_frame
        self.num_quantizers = decoder.cfg.num_quantizers
        # Pool tensors are only ever touched under inference mode (callers may or may not be in it).
        with torch.inference_mode():
            self._pool: dict[str, torch.Tensor] = decoder.empty_cache(max(1, initial_slots))
        self._free: list[int] = list(range(max(1, initial_slots)))[::-1]
        self._lock = threading.RLock()

    @property
    def capacity(self) -> int:
        return next(iter(self._pool.values())).shape[0]

    @property
    def num_active(self) -> int:
        return self.capacity - len(self._free)

    @property
    def state_nbytes(self) -> int:
        """Bytes of decoder history one stream holds."""
        return sum(t[0].numel() * t.element_size() for t in self._pool.values())

    def start(self, prefix_codes: torch.Tensor | None = None) -> DecoderState:
        """New stream; an ICL reference prefix [P, Q] is decoded now as context and never returned."""
        prefix = None
        if prefix_codes is not None and prefix_codes.shape[0] > 0:
            prefix = self._check_codes(prefix_codes)
        with self._lock:
            state = DecoderState(slot=self._alloc())
            if prefix is not None:
                self._run([state], [prefix])
                state.prefix_frames = state.frames
        return state

    def fork(self, state: DecoderState) -> DecoderState:
        """An independent copy of a stream's state (same history, own slot)."""
        self._check_live(state)
        with self._lock, torch.inference_mode():
            twin = DecoderState(slot=self._alloc(), frames=state.frames, prefix_frames=state.prefix_frames)
            for t in self._pool.values():
                t[twin.slot].copy_(t[state.slot])
        return twin

    def decode(self, state: DecoderState, codes: torch.Tensor) -> torch.Tensor:
        """Decode the next frames [n, Q] of one stream -> their samples [n * samples_per_frame]."""
        return self.decode_batch([state], [codes])[0]

    def decode_batch(self, states: list[DecoderState], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode the next frames of many streams at once; row i of the result belongs to states[i].

        Rows may have different lengths, including zero (that row's state is left untouched and an
        empty tensor is returned for it)."""
        if len(states) != len(codes):
            raise ValueError(f"{len(states)} states but {len(codes)} code chunks")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a decoder state appears twice in one batch")
        for s in states:
            self._check_live(s)
        checked = [self._check_codes(c) for c in codes]
        live = [i for i, c in enumerate(checked) if c.shape[0] > 0]
        outputs: list[torch.Tensor] = [
            torch.zeros(0, device=self.decoder.device, dtype=self.decoder.dtype) for _ in states
        ]
        if live:
            with self._lock:
                decoded = self._run([states[i] for i in live], [checked[i] for i in live])
            for i, wav in zip(live, decoded, strict=True):
                outputs[i] = wav
        return outputs

    def free(self, state: DecoderState) -> None:
        """Release the stream's slot; the state cannot be used again. Freeing twice is a no-op."""
        with self._lock:
            if state.freed:
                return
            state.freed = True
            self._free.append(state.slot)

    @torch.inference_mode()
    def _alloc(self) -> int:
        if not self._free:
            old = self.capacity
            grown = self.decoder.empty_cache(old)
            self._pool = {k: torch.cat([v, grown[k]], dim=0) for k, v in self._pool.items()}
            self._free = list(range(old, 2 * old))[::-1]
        slot = self._free.pop()
        # Zero history is exactly the causal zero padding of a fresh decode.
        for t in self._pool.values():
            t[slot].zero_()
        return slot

    def _check_live(self, state: DecoderState) -> None:
        if state.freed:
            raise ValueError("decoder state was freed")

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [n, {self.num_quantizers}], got {tuple(codes.shape)}")
        return codes.long()

    @torch.inference_mode()
    def _run(self, states: list[DecoderState], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode non-empty chunks of distinct states in one right-padded batch and write back."""
        dev = self.decoder.device
        lengths = [c.shape[0] for c in codes]
        longest = max(lengths)
        # Pad where the codes are (usually the CPU), then move the batch in one copy.
        batch = pad_sequence([c.to(codes[0].device) for c in codes], batch_first=True).to(dev)
        slots = torch.tensor([s.slot for s in states], dtype=torch.long, device=dev)
        cache = {k: v.index_select(0, slots) for k, v in self._pool.items()}
        positions = torch.tensor([s.frames for s in states], dtype=torch.long, device=dev)
        lens = torch.tensor(lengths, dtype=torch.long, device=dev)
        wav = self.decoder.forward_stream(batch, cache, positions, lens, uniform=min(lengths) == longest)
        for k, v in self._pool.items():
            v.index_copy_(0, slots, cache[k].to(v.dtype))
        spf = self.samples_per_frame
        out = []
        for row, (state, n) in enumerate(zip(states, lengths, strict=True)):
            # Each row is trimmed by its own length and written back to its own slot.
            out.append(wav[row, : n * spf])
            state.frames += n
        return out
