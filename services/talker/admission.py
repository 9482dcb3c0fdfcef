"""Real-time admission guard: a new stream starts only while the running ones keep their pace.

Under overload, admitting every request makes every stream late (each gets a smaller share of the
steps and of the pipeline behind them). The guard holds waiting requests in the queue instead, so
the admitted streams stay gap-free and the excess shows up as time to first audio (or, past the
queue bound, as RESOURCE_EXHAUSTED), never as gaps in audio already playing.

Two signals, each can be switched off (0):

- step time: an exponential average of the engine's step wall time (frame step plus any prefill
  in it) above `step_budget_s` means the GPU side is at its limit (one step makes one frame =
  80 ms of audio for every running stream);
- delivery lead: for every stream older than `warmup_s` since its first audio, lead = audio handed
  on to the caller minus wall time since the first audio, i.e. how much the listener has buffered
  if it plays in real time. More than `max_behind_fraction` of those streams under `min_lead_s`
  means the pipeline after the engine (code2wav, gateway, network) is not keeping up. A fraction,
  not the minimum, so that one slow client cannot stop admission for everyone.

A request is always admitted when nothing is running (there is nothing to protect).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GuardConfig:
    step_budget_s: float = 0.064  # 80% of a frame (80 ms); 0 = ignore step time
    min_lead_s: float = 0.5  # 0 = ignore delivery lead (audio arrives in chunks of up to 2 s)
    max_behind_fraction: float = 0.05
    warmup_s: float = 2.0
    ewma_alpha: float = 0.2
    # At most this many start per step, so the signals can react before the next ones start (a
    # burst admitted at once could overshoot the budget).
    max_admit_per_step: int = 16

    def __post_init__(self) -> None:
        if self.step_budget_s < 0 or self.min_lead_s < 0 or self.warmup_s < 0:
            raise ValueError("step_budget_s, min_lead_s and warmup_s must be >= 0")
        if not 0.0 <= self.max_behind_fraction < 1.0 or not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError("max_behind_fraction must be in [0, 1) and ewma_alpha in (0, 1]")
        if self.max_admit_per_step < 1:
            raise ValueError("max_admit_per_step must be >= 1")


class RealtimeGuard:
    """Decides whether the scheduler may start another stream now; see the module docstring.

    `observe_step` is called by the engine thread after every step; `allows` by the scheduler
    (same thread). Streams expose `first_audio_at` (perf_counter seconds, None before the first
    audio) and `delivered_s` (audio seconds handed on), written by the asyncio side."""

    def __init__(self, config: GuardConfig | None = None, clock=time.perf_counter):
        self.config = config or GuardConfig()
        self._clock = clock
        self.step_s: float | None = None
        self.reason = ""  # why admission is held ("" while open)

    def observe_step(self, seconds: float) -> None:
        a = self.config.ewma_alpha
        self.step_s = seconds if self.step_s is None else (1 - a) * self.step_s + a * seconds

    def allows(self, running: Iterable[Any]) -> bool:
        running = list(running)
        if not running:
            self.reason = ""
            return True
        cfg = self.config
        if cfg.step_budget_s > 0 and self.step_s is not None and self.step_s > cfg.step_budget_s:
            self.reason = f"step time {self.step_s * 1e3:.1f} ms over the {cfg.step_budget_s * 1e3:.0f} ms budget"
            return False
        if cfg.min_lead_s > 0:
            now = self._clock()
            mature = behind = 0
            for req in running:
                first = getattr(req, "first_audio_at", None)
                if first is None or now - first < cfg.warmup_s:
                    continue
                mature += 1
                if getattr(req, "delivered_s", 0.0) - (now - first) < cfg.min_lead_s:
                    behind += 1
            if mature and behind > cfg.max_behind_fraction * mature:
                self.reason = f"{behind} of {mature} streams under {cfg.min_lead_s * 1e3:.0f} ms of buffered audio"
                return False
        self.reason = ""
        return True
