"""Slot scheduler: which KV slot, prefill chunk and decode row each admitted stream gets, and
which streams finish, step by step (pure Python, no torch).

Layers: the deadline scheduler (services/talker/deadline.py) decides who waits, who runs and
who steps when, by playback deadline, and is the only queue: it adds a request here only while a
slot is free (`add` with every slot taken is an error, `NoFreeSlot`). This module owns the dense
slot table of the streams it was given; the engine (engine.py) runs its plans on the GPU.

Each step the slot scheduler
1. hands back the slot moves left by sequences that finished or were cancelled,
2. spends a per-step prefill budget (prompt positions) on the admitted sequences, oldest first,
   so a burst of new streams delays running ones by at most one budget's worth of prefill,
3. lists the rows of the decode batch: every occupied slot, active unless it is still
   prefilling or its stream asked to be skipped (no credit downstream), and
4. once the batch's frame is on the host, decides which rows finish (end of speech, broken
   sampling, frame cap) and frees their slots (`postprocess`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qtts.engine.kv_slots import DenseSlotTable, SlotMove
from qtts.engine.sequence import SeqStatus, Sequence
from qtts.model.step_output import SAMPLING_FAILED, StepOutput


class NoFreeSlot(RuntimeError):
    """`SlotScheduler.add` with every slot taken: the caller admits only while one is free."""


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions `[start, end)` of `seq` to write into its slot this step."""

    seq: Sequence
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end >= self.seq.num_prefill_positions


@dataclass(frozen=True)
class KVMove:
    """Copy the first `num_positions` KV positions and the per-slot state of `src` into `dst`."""

    src: int
    dst: int
    num_positions: int


@dataclass
class SlotPlan:
    """Work for one engine step, in the order the model runner must do it."""

    moves: list[KVMove] = field(default_factory=list)
    prefix_hits: list[Sequence] = field(default_factory=list)  # admitted with a cached prefix in KV
    prefills: list[PrefillChunk] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)  # prefill completed: load decode state
    num_rows: int = 0  # occupied slots = decode batch rows (row i is slot i)
    decode: list[Sequence] = field(default_factory=list)  # active rows, ordered by slot

    @property
    def has_decode(self) -> bool:
        return bool(self.decode)


class SlotScheduler:
    """Dense KV slots, chunked prefill budget, the decode batch and finishing."""

    def __init__(self, slots: DenseSlotTable, max_prefill_tokens: int) -> None:
        if max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        self.slots = slots
        self.max_prefill_tokens = max_prefill_tokens
        self.running: dict[str, Sequence] = {}  # by request id, in admission order; PREFILLING or RUNNING
        # Added since the last plan: their prefix is looked up, and their slot holds nothing of
        # theirs yet (a move into it copies nothing).
        self._added: dict[str, Sequence] = {}
        self._pending_moves: list[KVMove] = []

    # -- streams ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Give `seq` a slot now; it prefills from the next plan on. Raises `ValueError` when it
        can never fit a slot, `NoFreeSlot` when every slot is taken (nothing waits here)."""
        if not self.slots.fits(seq.max_positions):
            raise ValueError(
                f"request {seq.request_id!r} needs {seq.max_positions} KV positions, a slot holds "
                f"{self.slots.max_len}"
            )
        if self.slots.num_free == 0:
            raise NoFreeSlot(
                f"request {seq.request_id!r}: all {self.slots.num_slots} KV slots are taken (the "
                "deadline scheduler admits a request only while the engine has a free slot)"
            )
        seq.slot = self.slots.allocate(seq.request_id)
        seq.status = SeqStatus.PREFILLING
        self.running[seq.request_id] = seq
        self._added[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self.running.get(request_id)

    @property
    def num_free(self) -> int:
        """Slots a new request can take now."""
        return self.slots.num_free

    @property
    def num_active(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stop, length, frame cap or cancel) and free its slot."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.running.pop(seq.request_id, None) is not None:
            if self._added:
                self._added.pop(seq.request_id, None)
            self._release(seq)

    def cancel(self, request_id: str) -> Sequence | None:
        seq = self.running.get(request_id)
        if seq is not None:
            self.finish(seq, "cancelled")
        return seq

    def _release(self, seq: Sequence) -> None:
        move: SlotMove | None = self.slots.free(seq.request_id)
        seq.slot = -1
        if move is None:
            return
        self.running[move.key].slot = move.dst
        # The KV length is read when the move is planned: rows later in this step's output may
        # still count the frame that this step's decode already wrote.
        self._pending_moves.append(KVMove(move.src, move.dst, 0))

    # -- planning --------------------------------------------------------------------------
    def schedule(
        self, prefix_lookup: Callable[[Sequence], int] | None = None, prefill_budget: int | None = None
    ) -> SlotPlan:
        """Plan one step. `prefix_lookup(seq)` returns how many leading prompt positions a cache
        already holds for `seq` (the runner copies them into the slot before prefilling);
        `prefill_budget` lowers this step's prefill budget (the caller's deadline slack)."""
        moves = compose_moves(self._pending_moves, self.slots.num_used)
        self._pending_moves = []
        added, self._added = self._added, {}
        # A sequence added since the last plan has nothing in its slot yet: moving it copies nothing
        # (and the slot it left may hold the KV of one that finished there).
        owners = [(m, self.slots.owner(m.dst)) for m in moves]
        plan = SlotPlan(
            moves=[
                KVMove(m.src, m.dst, self.running[o].num_kv_positions) for m, o in owners if o not in added
            ]
        )
        if prefix_lookup is not None:
            for seq in added.values():
                hit = prefix_lookup(seq) if seq.prefix_key is not None else 0
                if hit > 0:
                    seq.num_prefilled = min(hit, seq.num_prefill_positions)
                    plan.prefix_hits.append(seq)
        # A budget of 0: no prefill this step (the caller holds new prompts back to batch them).
        budget = (
            self.max_prefill_tokens
            if prefill_budget is None
            else max(0, min(prefill_budget, self.max_prefill_tokens))
        )
        for seq in self.running.values():  # insertion order = admission order
            if seq.status is not SeqStatus.PREFILLING or budget <= 0:
                continue
            start = seq.num_prefilled
            end = min(seq.num_prefill_positions, start + budget)
            if end > start:
                plan.prefills.append(PrefillChunk(seq, start, end))
                budget -= end - start
            elif seq.prefill_done:
                # Nothing left to write (a one-position prompt or a whole-prompt prefix hit).
                plan.prefills.append(PrefillChunk(seq, start, end))
        plan.num_rows = self.slots.num_used
        return plan

    def mark_prefilled(self, plan: SlotPlan) -> None:
        """After the runner wrote the chunks: advance counters, start finished prompts."""
        for chunk in plan.prefills:
            chunk.seq.num_prefilled = chunk.end
            if chunk.completes:
                chunk.seq.status = SeqStatus.RUNNING
                plan.started.append(chunk.seq)

    def decode_rows(self, plan: SlotPlan, skip: frozenset[str] | set[str] = frozenset()) -> list[Sequence]:
        """The sequences that produce a frame this step, ordered by slot."""
        rows = [
            s for s in self.running.values() if s.status is SeqStatus.RUNNING and s.request_id not in skip
        ]
        rows.sort(key=lambda s: s.slot)
        plan.decode = rows
        return rows

    def postprocess(self, rows: list[Sequence], host: Any, eos_id: int) -> list[StepOutput]:
        """Finish the step: each decode row's output, and the rows that end here leave.

        `host` is the step's frame as one int16 host array [num_rows, num_codebooks] (row i is
        slot i; a negative code is the sampler's INVALID_ID: that row's scores broke). A row ends
        on a broken sampling (SAMPLING_FAILED, no codes), on end of speech (codebook 0 is
        `eos_id`: "stop", no codes) or at its frame bound (its `cap_reason`, with the frame).
        Each output with codes holds a row view of `host`: one host array per step, no per-row
        copies (they cost the engine thread milliseconds a step at hundreds of streams).
        """
        c0 = host[:, 0].tolist()
        broken = (host < 0).any(axis=1).tolist()
        outputs: list[StepOutput] = []
        # Finishing a stream moves another into its slot: read every row by its slot at decode time.
        for seq, slot in [(s, s.slot) for s in rows]:
            if broken[slot]:
                outputs.append(StepOutput(seq.request_id, None, True, SAMPLING_FAILED))
                self.finish(seq, SAMPLING_FAILED)
                continue
            if c0[slot] == eos_id:
                outputs.append(StepOutput(seq.request_id, None, True, "stop"))
                self.finish(seq, "stop")
                continue
            seq.num_frames += 1
            if seq.num_frames >= seq.max_frames:
                outputs.append(StepOutput(seq.request_id, host[slot], True, seq.cap_reason))
                self.finish(seq, seq.cap_reason)
            else:
                outputs.append(StepOutput(seq.request_id, host[slot], False, None))
        return outputs


def compose_moves(moves: list[KVMove], num_used: int) -> list[KVMove]:
    """Collapse a sequence of moves into independent copies `origin -> final slot`.

    A sequence can move twice before the runner sees the moves (its new slot is freed by a later
    move); composing lets the runner copy every row once, all in one batched index copy, because
    no composed destination is also a composed source. Moves of sequences that left afterwards
    (their final slot is beyond the `num_used` occupied ones) are dropped.
    """
    origin_of: dict[int, tuple[int, int]] = {}  # current slot -> (original slot, positions)
    for m in moves:
        origin, _ = origin_of.pop(m.src, (m.src, m.num_positions))
        origin_of[m.dst] = (origin, m.num_positions)
    return [KVMove(src, dst, n) for dst, (src, n) in origin_of.items() if src != dst and dst < num_used]
