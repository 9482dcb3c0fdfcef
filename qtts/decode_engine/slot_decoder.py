"""`SlotDecoder`: code2wav's engine, `IncrementalDecoder`'s operations over a static slot pool.

It is driven from one thread (the code2wav decode worker); it is not thread-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from qtts.decode_engine.batcher import BatchPlanner, PieceCollector, PlannerConfig, WorkItem
from qtts.decode_engine.prefix_states import PrefixStateCache, Snapshot
from qtts.decode_engine.runner import CONV_STACKS, PRECISIONS, StepRunner
from qtts.decode_engine.slots import SlotPool
from qtts.model.codec_decoder import CodecDecoder, load_codec_decoder

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The service's default plan is 2, 2, 4, 8, then 16 frames; other lengths a client asks for are cut
# into these (exactly: the state carries from piece to piece), 1 fills any remainder.
DEFAULT_CHUNK_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class SlotDecoderConfig:
    """Pool size, precision and captured shapes of a `SlotDecoder`; validated on construction."""

    max_streams: int = 256
    precision: str = "tf32"  # fp32 (reference) | tf32 | bf16 (fast path)
    # Layout of the conv stack (most of the decoder's time): "channels_last" (GEMMs, NHWC convs,
    # fused SnakeBeta passes; see conv_stack_cl; on one H200, bf16, chunk 16: 19.8 us a frame at
    # 512 streams against 26.9, SNR 37.4 dB against fp32), "channels_first" (the checkpoint's layout,
    # the reference) or "channels_last_fused" (residual units as Triton GEMMs; slower today).
    conv_stack: str = "channels_last"
    cuda_graphs: bool = True
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES
    # Bound on batch x frames per step (activation memory of one step grows with it).
    max_step_frames: int = 3200
    # Cut chunks of uncaptured lengths into captured ones (exact; graph replays beat eager calls).
    split_to_captured: bool = True
    cudnn_benchmark: bool = True
    # CPU only: run the static-buffer path without graphs (tests of padding and buffers).
    emulate_graphs: bool = False
    # Decoder states right after a reference prefix, kept per distinct prefix (LRU; 0 = off): a
    # stream of a voice seen before copies its state instead of decoding the prefix again.
    # Each entry holds one slot's state (`SlotPool.slot_bytes()`).
    prefix_cache_entries: int = 512

    def __post_init__(self) -> None:
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.conv_stack not in CONV_STACKS:
            raise ValueError(f"conv_stack must be one of {CONV_STACKS}, got {self.conv_stack!r}")
        if self.max_step_frames < 1:
            raise ValueError(f"max_step_frames must be >= 1, got {self.max_step_frames}")
        if self.prefix_cache_entries < 0:
            raise ValueError(f"prefix_cache_entries must be >= 0, got {self.prefix_cache_entries}")
        # Shape sanity (distinct, positive) is checked by PlannerConfig.
        PlannerConfig(
            self.chunk_sizes, self.batch_sizes, max(self.chunk_sizes, default=1), self.max_step_frames
        )


@dataclass(eq=False)
class SlotState:
    """A stream's handle: its stage-local stream id, its pool slot and its frame counters.

    `frames` counts every frame decoded (prefix included) and is the position of the next frame;
    `prefix_frames` is the reference prefix whose audio is never returned."""

    id: int
    slot: int
    frames: int = 0
    prefix_frames: int = 0
    freed: bool = False
    failed: bool = field(default=False, repr=False)

    @property
    def output_frames(self) -> int:
        return self.frames - self.prefix_frames


class SlotDecoder:
    """Stateful chunked decoding for many streams at once; see the module docstring."""

    # Codes are best passed as CPU tensors: one step gathers every row into one host-to-device copy.
    accepts_host_codes = True

    def __init__(self, decoder: CodecDecoder, config: SlotDecoderConfig | None = None):
        self.config = config or SlotDecoderConfig()
        cfg = self.config
        self.decoder = decoder
        self.samples_per_frame = decoder.samples_per_frame
        self.num_quantizers = decoder.cfg.num_quantizers
        self.device = decoder.device
        self.runner = StepRunner(
            decoder,
            cfg.max_streams,
            precision=cfg.precision,
            emulate_graphs=cfg.emulate_graphs,
            conv_stack=cfg.conv_stack,
        )
        self.window = self.runner.window
        self.steps_total = 0  # decoder runs (graph replays or eager steps) so far, for metrics
        static = cfg.cuda_graphs and (self.device.type == "cuda" or cfg.emulate_graphs)
        self.planner = BatchPlanner(
            PlannerConfig(
                chunk_sizes=tuple(c for c in cfg.chunk_sizes if c <= self.window) if static else (),
                batch_sizes=cfg.batch_sizes if static else (),
                max_chunk_frames=self.window,
                max_step_frames=cfg.max_step_frames,
                split_to_captured=cfg.split_to_captured,
            )
        )
        self._ids = itertools.count(1)
        self._live: dict[int, SlotState] = {}
        self._prefix_states = PrefixStateCache(self.pool, cfg.prefix_cache_entries)

    # ------------------------------------------------------------------ set-up

    @property
    def pool(self) -> SlotPool:
        return self.runner.pool

    @property
    def prefix_hits(self) -> int:
        """Starts with a prefix whose state was copied (from the cache, or from an equal prefix
        decoded in the same `start_many`)."""
        return self._prefix_states.hits

    @property
    def prefix_misses(self) -> int:
        """Starts with a prefix that was decoded."""
        return self._prefix_states.misses

    def capture(self, extra_shapes: Sequence[tuple[int, int]] = ()) -> int:
        """Capture every (batch, chunk) shape the planner can pick, plus `extra_shapes`, in one
        call (no-op on CPU unless emulated); returns how many shapes are captured."""
        pc = self.planner.config
        shapes = [
            (b, c) for c in pc.chunk_sizes for b in pc.batch_sizes if b * c <= max(pc.max_step_frames, c)
        ]
        return self.runner.capture(shapes + list(extra_shapes), cudnn_benchmark=self.config.cudnn_benchmark)

    # ------------------------------------------------------------------ IncrementalDecoder API

    @property
    def num_live(self) -> int:
        return len(self._live)

    def start(self, prefix_codes: torch.Tensor | None = None) -> SlotState:
        """New stream in a free slot (`SlotPoolFull` when none); an ICL reference prefix [P, Q] is
        decoded now as context and never returned."""
        state = self.start_many([prefix_codes])[0]
        if isinstance(state, Exception):
            raise state
        return state

    def prefix_cached(self, prefix: np.ndarray) -> bool:
        """Whether a stream starting after `prefix` (int frames [n, codebooks]) would copy a cached
        state rather than decode it: what `StateStarter` counts a start's cost by. Callable from
        any thread (a read of the cache's keys)."""
        return self._prefix_states.holds(torch.from_numpy(np.ascontiguousarray(prefix, dtype=np.int64)))

    def start_many(self, prefixes: Sequence[torch.Tensor | None]) -> list[SlotState | Exception]:
        """`start` for several new streams in one pass: result i is the state after prefixes[i], or
        the error that stream met (its slot is freed; the other streams are not affected, except
        that a decode error fails every stream whose prefix was decoded in that call).

        Cached prefixes are copied; the others are decoded together (`_decode_prefixes`); a prefix
        that appears twice is decoded once and copied, as `start` after `start` would."""
        results: list[SlotState | Exception] = []
        misses: list[tuple[SlotState, torch.Tensor, bytes | None]] = []
        copies: list[tuple[SlotState, bytes]] = []  # equal to a prefix decoded in this call
        cache = self._prefix_states
        try:
            for codes in prefixes:
                try:
                    prefix = None if codes is None or codes.shape[0] == 0 else self._check_codes(codes)
                    state = self._allocate()
                except Exception as exc:  # noqa: BLE001 - this stream fails, the others go on
                    results.append(exc)
                    continue
                results.append(state)
                if prefix is None:
                    continue
                key = cache.key(prefix)
                if (snap := cache.get(key)) is not None:
                    cache.hits += 1
                    self._restore(state, snap)
                elif key is not None and any(key == k for _, _, k in misses):
                    cache.hits += 1
                    copies.append((state, key))
                else:
                    cache.misses += 1
                    misses.append((state, prefix, key))
            made, errors = self._decode_prefixes(misses)
            for state, key in copies:
                if key in made:
                    self._restore(state, made[key])
                else:
                    errors[state.id] = errors[next(s.id for s, _, k in misses if k == key)]
        except BaseException:
            for r in results:
                if isinstance(r, SlotState):
                    self.free(r)
            raise
        for i, r in enumerate(results):
            if isinstance(r, SlotState) and r.id in errors:
                self.free(r)
                results[i] = errors[r.id]
        return results

    def reset(self, state: SlotState, prefix_codes: torch.Tensor | None = None) -> SlotState:
        """Restart a stream from scratch (its old state is freed, a new one started)."""
        self.free(state)
        return self.start(prefix_codes)

    def decode(self, state: SlotState, codes: torch.Tensor) -> torch.Tensor:
        """Decode the next frames [n, Q] of one stream -> their samples [n * samples_per_frame]."""
        return self.decode_batch([state], [codes])[0]

    def decode_batch(self, states: list[SlotState], codes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode the next frames of many streams; result i belongs to states[i] (rows may be empty)."""
        if len(states) != len(codes):
            raise ValueError(f"{len(states)} states but {len(codes)} code chunks")
        if len({s.id for s in states}) != len(states):
            raise ValueError("a decoder state appears twice in one batch")
        checked = [self._check_codes(c) for c in codes]
        for s in states:
            self._check_state(s)
        return self._decode(states, checked)

    def _decode(self, states: list[SlotState], checked: list[torch.Tensor]) -> list[torch.Tensor]:
        by_id = {s.id: (s, c) for s, c in zip(states, checked, strict=True)}
        items = [WorkItem(s.id, c.shape[0], first=s.output_frames == 0) for s, c in by_id.values()]
        collector: PieceCollector[torch.Tensor] = PieceCollector()
        try:
            for step in self.planner.plan(items):
                rows = [by_id[r.stream_id] for r in step.rows]
                chunks = [
                    c[r.offset : r.offset + step.frames] for r, (_, c) in zip(step.rows, rows, strict=True)
                ]
                slots = [s.slot for s, _ in rows]
                positions = [s.frames for s, _ in rows]
                if step.captured and self.runner.has_graph(step.batch, step.frames):
                    # Copy out of the shared output buffer before the next step reuses it.
                    wav = self.runner.run_static(step.batch, slots, positions, chunks).clone()
                else:
                    wav = self.runner.run_eager(slots, positions, chunks)
                collector.add(step, list(wav.unbind(0)))
                self.steps_total += 1
                for s, _ in rows:
                    s.frames += step.frames
        except BaseException:
            # Some of these streams' histories may be half-updated: they can not continue.
            for s in states:
                s.failed = True
            raise
        empty = torch.zeros(0, device=self.device, dtype=torch.float32)
        out = []
        for s in states:
            pieces = collector.get(s.id)
            out.append(empty if not pieces else pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        return out

    def free(self, state: SlotState) -> None:
        """Return the stream's slot (on finish, error, cancel or reset). Idempotent."""
        if state.freed:
            return
        state.freed = True
        self._live.pop(state.id, None)
        self.pool.release(state.slot, state.id)

    def free_all(self) -> int:
        """Free every live stream (shutdown); returns how many were live."""
        live = list(self._live.values())
        for s in live:
            self.free(s)
        return len(live)

    # ------------------------------------------------------------------ internals

    def _check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 2 or codes.shape[1] != self.num_quantizers:
            raise ValueError(f"codes must be [n, {self.num_quantizers}], got {tuple(codes.shape)}")
        if codes.device.type == "cuda":
            return codes.to(dtype=torch.long)
        # Host codes stay on the host: the step packs them into one pinned buffer and one copy.
        return codes.to(dtype=torch.long).contiguous()

    def _check_state(self, state: SlotState) -> None:
        if state.freed:
            raise ValueError("decoder state was freed")
        if state.failed:
            raise ValueError("decoder state is unusable after a failed decode")
        self.pool.check(state.slot, state.id)

    def _allocate(self) -> SlotState:
        sid = next(self._ids)
        state = SlotState(id=sid, slot=self.pool.allocate(sid))
        self._live[sid] = state
        return state

    def _restore(self, state: SlotState, snap: Snapshot) -> None:
        self.pool.restore(state.slot, snap[0])
        state.frames = state.prefix_frames = snap[1]

    def _decode_prefixes(
        self, items: list[tuple[SlotState, torch.Tensor, bytes | None]]
    ) -> tuple[dict[bytes, Snapshot], dict[int, Exception]]:
        """Run reference prefixes through the decoder, keeping only their states (cached under
        their keys): (snapshot by key, error by stream id of those that failed).

        The frame-rate part (pre-conv, transformer) sees every prefix frame, in eager windows
        shared by the prefixes of equal length; the upsampler and conv blocks only the last
        `prefix_tail_frames` (their receptive field, plus one): their history at the end of the
        prefix is then exactly that of a full decode, at a fraction of the cost. Those tails are
        equally long for every prefix past that length, so all of them go through one `_decode`."""
        run = self.runner
        errors: dict[int, Exception] = {}
        groups: dict[int, list[tuple[SlotState, torch.Tensor]]] = {}
        for state, prefix, _ in items:
            groups.setdefault(max(0, prefix.shape[0] - run.prefix_tail_frames), []).append((state, prefix))
        # Rows of one eager window at most (activation memory, as `max_step_frames` bounds a step).
        rows = max(1, self.config.max_step_frames // self.window)
        for head, group in groups.items():
            for i in range(0, len(group), rows):
                part = group[i : i + rows]
                try:
                    for start in range(0, head, self.window):
                        end = min(start + self.window, head)
                        slots, positions = [s.slot for s, _ in part], [s.frames for s, _ in part]
                        run.run_eager(slots, positions, [p[start:end] for _, p in part], frame_only=True)
                        for s, _ in part:
                            s.frames += end - start
                except Exception as exc:  # noqa: BLE001 - these streams fail, the others go on
                    errors.update((s.id, exc) for s, _ in part)
        tails = [
            (s, p[max(0, p.shape[0] - run.prefix_tail_frames) :]) for s, p, _ in items if s.id not in errors
        ]
        if tails:
            try:
                # The tails' audio is dropped.
                self._decode([s for s, _ in tails], [t for _, t in tails])
            except Exception as exc:  # noqa: BLE001 - a failed call fails its streams (as decode_batch)
                errors.update((s.id, exc) for s, _ in tails)
        made: dict[bytes, Snapshot] = {}
        for state, _, key in items:
            if state.id not in errors:
                state.prefix_frames = state.frames
                if key is not None:
                    made[key] = self._prefix_states.put(key, state.slot, state.frames)
        return made, errors


def build_slot_decoder(decoder: CodecDecoder, config: SlotDecoderConfig | None = None) -> SlotDecoder:
    """A `SlotDecoder` with its CUDA graphs captured (start-up cost: seconds per shape)."""
    engine = SlotDecoder(decoder, config)
    engine.capture()
    return engine


def load_slot_decoder(
    path_or_id: str,
    *,
    device: str | torch.device = "cuda",
    load_format: str = "auto",
    config: SlotDecoderConfig | None = None,
) -> SlotDecoder:
    """Load the codec decoder (fp32 reference weights; `config.precision` picks the compute path)
    and build a captured `SlotDecoder` on it: the one call code2wav's model loader needs."""
    decoder = load_codec_decoder(path_or_id, device=device, dtype=torch.float32, load_format=load_format)
    return build_slot_decoder(decoder, config)
