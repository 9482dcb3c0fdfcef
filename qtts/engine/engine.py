"""GraphEngine: the talker's continuous-batching engine (same public interface as EagerGenerator).

`step()` is: plan (scheduler), move / load / prefill KV (runner), one batched frame for every
running stream (runner: one CUDA graph replay on the GPU), then retire finished streams.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from qtts.engine.kv_slots import DenseSlotTable
from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.scheduler import Scheduler
from qtts.engine.sequence import Sequence
from qtts.errors import InvalidArgument
from qtts.model.generator import SAMPLING_FAILED, StepOutput


@dataclass(frozen=True)
class EngineConfig:
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
        self, bundle, max_batch: int = 64, config: EngineConfig | None = None, capture: bool = True
    ) -> None:
        if config is None:
            config = EngineConfig(runner=RunnerConfig(max_batch=max_batch))
        self.config = config
        self.bundle = bundle
        self.runner = ModelRunner(bundle, config.runner)
        self.scheduler = Scheduler(
            DenseSlotTable(self.runner.num_slots, self.runner.max_len), config.max_prefill_tokens
        )
        if capture:
            self.runner.capture_graphs()

    # -- public API (docs/interfaces.md, EagerGenerator) ------------------------------------------
    @property
    def num_active(self) -> int:
        """Requests admitted and not finished (running or waiting for their prefill)."""
        return self.scheduler.num_active

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def max_batch(self) -> int:
        return self.runner.num_slots

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
        """Queue a request. `prefix_key`/`prefix_len` (or the prompt's attributes of those names)
        name the leading prompt positions that depend only on the voice, for the prefix cache."""
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
        cap = min(int(prompt.max_frames), room)  # the text's frame cap, or what the slot holds
        if max_new_frames is None and getattr(prompt, "default_max_frames", None):
            # The model's own bound for callers that give none: ends as "length", like theirs.
            max_new_frames = min(int(prompt.default_max_frames), cap)
        if max_new_frames is not None:
            # The caller bounded the length: reaching that bound, or the text's cap below it, ends
            # as "length". Only an unbounded run into the cap is a failure (no end of speech).
            max_frames, reason = min(max_new_frames, cap), "length"
        else:
            max_frames, reason = cap, "frame_cap"
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        key = prefix_key if prefix_key is not None else getattr(prompt, "prefix_key", None)
        plen = prefix_len if prefix_len is not None else getattr(prompt, "prefix_len", 0) or 0
        plen = min(int(plen), prompt_len - 1)
        use_prefix = self.runner.prefix_cache is not None and key is not None and plen > 0
        seq = Sequence(
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            seed=int(seed) & ((1 << 63) - 1),
            max_frames=max_frames,
            cap_reason=reason,
            prefix_key=key if use_prefix else None,
            prefix_len=plen if use_prefix else 0,
        )
        self.scheduler.add(seq)

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its KV slot; False if it is unknown (or already finished)."""
        return self.scheduler.cancel(request_id) is not None

    @torch.inference_mode()
    def step(
        self, skip: frozenset[str] | set[str] | tuple = (), prefill_budget: int | None = None
    ) -> list[StepOutput]:
        """Admit and prefill (within `prefill_budget` prompt positions, at most the configured
        budget), then one frame for every running request not in `skip` (streams without
        downstream credit, or paused ahead of their listener, keep their state and wait)."""
        sched, runner = self.scheduler, self.runner
        cache = runner.prefix_cache
        plan = sched.schedule(
            (lambda s: cache.lookup(s.prefix_key)) if cache is not None else None, prefill_budget
        )
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
        rows = sched.decode_rows(plan, frozenset(skip))
        if not rows:
            return []
        ctx = max(s.next_position for s in rows) + 1
        codes = runner.decode(plan.num_rows, [s.slot for s in rows], ctx)
        return self._postprocess(rows, codes)

    def _postprocess(self, rows: list[Sequence], codes: torch.Tensor) -> list[StepOutput]:
        eos = self.runner.eos_id
        # One int16 host array per step; each output holds a row view of it (per-row tensor clones
        # cost the engine thread milliseconds a step at hundreds of streams, contending for the GIL).
        host = codes.to(torch.int16).numpy()
        c0 = host[:, 0].tolist()
        broken = (host < 0).any(axis=1).tolist()  # sampler.INVALID_ID: this row's scores broke
        outputs: list[StepOutput] = []
        # Finishing a stream moves another into its slot: read every row by its slot at decode time.
        for seq, slot in [(s, s.slot) for s in rows]:
            if broken[slot]:
                outputs.append(StepOutput(seq.request_id, None, True, SAMPLING_FAILED))
                self.scheduler.finish(seq, SAMPLING_FAILED)
                continue
            if c0[slot] == eos:
                outputs.append(StepOutput(seq.request_id, None, True, "stop"))
                self.scheduler.finish(seq, "stop")
                continue
            seq.num_frames += 1
            if seq.num_frames >= seq.max_frames:
                outputs.append(StepOutput(seq.request_id, host[slot], True, seq.cap_reason))
                self.scheduler.finish(seq, seq.cap_reason)
            else:
                outputs.append(StepOutput(seq.request_id, host[slot], False, None))
        return outputs
