"""GraphEngine: runs the slot scheduler's plans on the GPU (same public interface as EagerGenerator).

Layers: the deadline scheduler (services/talker/deadline.py) decides who waits, runs and steps;
the slot scheduler (slot_scheduler.py) which slot, prefill chunk and decode row each stream gets
and which ones finish; this engine only runs a plan, on the model runner. `add` takes a slot at
once (the deadline scheduler adds only while one is free), so nothing waits here.

`step()` is: plan = scheduler.schedule(); run it (KV moves, cached prefixes, prefill chunks,
decode state of the prompts done, one batched frame for every running stream: one CUDA graph
replay); outputs = scheduler.postprocess(), which retires the streams that finished.

Streams whose text is still arriving (an open `TextFeed` on the prompt) get their new trailing
embeddings copied into their slot before the step, and sit the step out while the text for their
next input has not arrived (no `tts_pad` that would end their speech). Only those streams are
looked at one by one; every other row costs the step nothing extra.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import torch

from qtts.engine.kv_slots import DenseSlotTable
from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.sequence import SeqStatus, Sequence
from qtts.engine.slot_scheduler import SlotPlan, SlotScheduler
from qtts.model.step_output import StepOutput
from qtts.request.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphEngineConfig:
    """Engine settings: the runner's sizes plus the per-step prefill budget."""

    runner: RunnerConfig = field(default_factory=RunnerConfig)
    # Prompt positions prefilled per step: bounds a running stream's stall, and must keep up with
    # arrivals (1,000 streams of 8 s with 300-position prompts need about 3,000 a step).
    max_prefill_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")


class GraphEngine:
    """Static KV slots, chunked batched prefill, one graph-captured frame step per batch bucket."""

    def __init__(
        self, bundle, max_batch: int = 64, config: GraphEngineConfig | None = None, capture: bool = True
    ) -> None:
        if config is None:
            config = GraphEngineConfig(runner=RunnerConfig(max_batch=max_batch))
        self.config = config
        self.bundle = bundle
        self.runner = ModelRunner(bundle, config.runner)
        self.scheduler = SlotScheduler(
            DenseSlotTable(self.runner.num_slots, self.runner.max_len), config.max_prefill_tokens
        )
        self._open_text: dict[str, Sequence] = {}  # sequences whose text feed is still open
        if capture:
            self.runner.capture_graphs()

    # -- public API (docs/interfaces.md, EagerGenerator) ------------------------------------------
    @property
    def num_active(self) -> int:
        """Requests added and not finished (running, or their prompt still prefilling)."""
        return self.scheduler.num_active

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def max_batch(self) -> int:
        """KV slots: the most requests added at once (may be below the configured `max_batch`
        when GPU memory holds fewer)."""
        return self.runner.num_slots

    @property
    def num_free_slots(self) -> int:
        """Requests `add` can take now."""
        return self.scheduler.num_free

    @property
    def max_text_positions(self) -> int:
        """Trailing text positions a stream's slot holds (text appended while it runs included)."""
        return self.config.runner.max_trailing

    def add(
        self,
        request_id: str,
        prompt,
        sampling,
        max_new_frames: int | None = None,
        *,
        prefix_key: str | None = None,
        prefix_len: int | None = None,
    ) -> None:
        """Start a request in a free KV slot (it prefills from the next step on; with every slot
        taken this raises `NoFreeSlot`: the caller admits only while one is free).
        `prefix_key`/`prefix_len` (or the prompt's attributes of those names) name the leading
        prompt positions that depend only on the voice, for the prefix cache."""
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request {request_id!r} is already running")
        if max_new_frames is not None and max_new_frames < 1:
            raise ValueError("max_new_frames must be >= 1")
        sampling.validate()
        n_trail = int(prompt.trailing.shape[0]) if prompt.trailing is not None else 0
        if n_trail > self.config.runner.max_trailing:
            raise InvalidArgument(
                f"the text is too long for this talker: {n_trail} text positions after the prompt, at most "
                f"{self.config.runner.max_trailing}; split it into several requests"
            )
        # A slot holds the prompt plus one position per frame (and the EOS step).
        prompt_len = int(prompt.embeds.shape[0])
        room = self.runner.max_len - prompt_len
        if room < 2:
            raise InvalidArgument(
                f"the prompt takes {prompt_len} positions, this talker holds {self.runner.max_len} "
                "per stream (--max-len); use a shorter text or reference, or raise --max-len"
            )
        if max_new_frames is not None and max_new_frames > room:
            raise InvalidArgument(
                f"max_new_frames={max_new_frames} does not fit: this talker holds {self.runner.max_len} positions "
                f"per stream (--max-len) and the prompt takes {prompt_len}, so at most {room} frames"
            )
        seq = self._new_sequence(
            request_id, prompt, sampling, max_new_frames, prefix_key, prefix_len, prompt_len, room
        )
        self.scheduler.add(seq)
        if seq.text_feed is not None:
            self._open_text[request_id] = seq

    def _new_sequence(
        self,
        request_id: str,
        prompt,
        sampling,
        max_new_frames: int | None,
        prefix_key: str | None,
        prefix_len: int | None,
        prompt_len: int,
        room: int,
    ) -> Sequence:
        """`add`'s request as a `Sequence`: its frame bound, seed and prefix-cache span."""
        feed = getattr(prompt, "text_feed", None)
        if feed is None:
            max_frames, reason = self._frame_bound(
                prompt.max_frames, getattr(prompt, "default_max_frames", None), max_new_frames, room
            )
        else:  # the text's bounds come with its end; meanwhile what the slot holds
            max_frames, reason = self._frame_bound(room, None, max_new_frames, room)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        key = prefix_key if prefix_key is not None else getattr(prompt, "prefix_key", None)
        plen = prefix_len if prefix_len is not None else getattr(prompt, "prefix_len", 0) or 0
        plen = min(int(plen), prompt_len - 1)
        use_prefix = self.runner.prefix_cache is not None and key is not None and plen > 0
        return Sequence(
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            seed=int(seed) & ((1 << 63) - 1),
            max_frames=max_frames,
            cap_reason=reason,
            prefix_key=key if use_prefix else None,
            prefix_len=plen if use_prefix else 0,
            text_feed=feed,
            max_new_frames=max_new_frames,
        )

    @staticmethod
    def _frame_bound(
        text_cap: int, default_max: int | None, max_new_frames: int | None, room: int
    ) -> tuple[int, str]:
        """(most frames, finish reason when they are reached) of a stream."""
        cap = min(int(text_cap), room)  # the text's frame cap, or what the slot holds
        if max_new_frames is None and default_max:
            # The model's own bound for callers that give none: ends as "length", like theirs.
            max_new_frames = min(int(default_max), cap)
        if max_new_frames is not None:
            # The caller bounded the length: reaching that bound, or the text's cap below it, ends
            # as "length". Only an unbounded run into the cap is a failure (no end of speech).
            return min(max_new_frames, cap), "length"
        return cap, "frame_cap"

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its KV slot; False if it is unknown (or already finished)."""
        self._open_text.pop(request_id, None)
        return self.scheduler.cancel(request_id) is not None

    @torch.inference_mode()
    def step(
        self, skip: frozenset[str] | set[str] | tuple = (), prefill_budget: int | None = None
    ) -> list[StepOutput]:
        """Prefill the added prompts (within `prefill_budget` prompt positions, at most the
        configured budget), then one frame for every running request not in `skip` (streams
        without downstream credit, or paused ahead of their listener, keep their state and wait)."""
        sched, runner = self.scheduler, self.runner
        # Schedule: slot moves, cached prefixes and prefill chunks.
        cache = runner.prefix_cache
        plan = sched.schedule(
            (lambda s: cache.lookup(s.prefix_key)) if cache is not None else None, prefill_budget
        )
        # Run: the plan's KV work, then one batched frame for the decode rows.
        self._run_prefill(plan)
        if self._open_text:
            skip = frozenset(skip) | self._take_text()
        rows = sched.decode_rows(plan, frozenset(skip))
        if not rows:
            return []
        ctx = max(s.next_position for s in rows) + 1
        codes = runner.decode(plan.num_rows, [s.slot for s in rows], ctx)
        # Postprocess: the scheduler reads the step's one int16 host array and retires the
        # streams that finished.
        return sched.postprocess(rows, codes.to(torch.int16).numpy(), runner.eos_id)

    def _run_prefill(self, plan: SlotPlan) -> None:
        """The plan's KV work before the frame: slot moves, cached prefixes, prefill chunks (and
        the prefixes they complete into the cache), decode state of the prompts now done."""
        sched, runner = self.scheduler, self.runner
        cache = runner.prefix_cache
        runner.apply_moves(plan.moves)
        if plan.prefix_hits:
            runner.load_prefixes(plan.prefix_hits)
        runner.prefill(plan.prefills)
        sched.mark_prefilled(plan)
        if cache is not None:
            for chunk in plan.prefills:
                seq = chunk.seq
                if (
                    seq.prefix_key is not None
                    and chunk.start < seq.prefix_len <= chunk.end
                    and seq.prefix_key not in cache
                ):
                    runner.store_prefix(seq)
        runner.start(plan.started)
        for seq in plan.started:
            seq.num_trailing = int(seq.prompt.trailing.shape[0]) if seq.prompt.trailing is not None else 0

    def _take_text(self) -> set[str]:
        """Copy the open feeds' new text into their slots; the ids of streams still waiting for
        theirs (or still prefilling: their text is copied once their slot state is loaded)."""
        waiting = set()
        runner = self.runner
        for rid, seq in list(self._open_text.items()):
            if seq.status is SeqStatus.FINISHED:
                del self._open_text[rid]
                continue
            if seq.status is not SeqStatus.RUNNING:
                continue
            feed = seq.text_feed
            chunks, closed = feed.chunks_from(seq.chunks_taken)
            if chunks:
                embeds = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
                room = runner.cfg.max_trailing - seq.num_trailing
                if embeds.shape[0] > room:  # the talker checks before it appends; never cut silently
                    log.error("request %s: %d trailing text positions dropped", rid, embeds.shape[0] - room)
                    embeds = embeds[:room]
                runner.append_trailing(seq.slot, seq.num_trailing, embeds, seq.prompt.pad_embed)
                seq.num_trailing += int(embeds.shape[0])
                seq.chunks_taken += len(chunks)
            if closed:
                del self._open_text[rid]
                seq.text_feed = None
                room = runner.max_len - seq.prompt_len
                seq.max_frames, seq.cap_reason = self._frame_bound(
                    feed.max_frames, feed.default_max_frames, seq.max_new_frames, room
                )
            elif seq.waiting_for_text:
                waiting.add(rid)
        return waiting
