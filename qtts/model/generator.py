"""EagerGenerator: continuous batching of talker + code predictor in eager PyTorch.

Requests join (prefill, batched) and leave (EOS, length, frame cap, cancel) between steps; every
`step()` produces one 16-code frame for every active request. Each request owns one row ("slot") of
a shared KV cache; its tokens sit at their own positions 0.., so requests of different lengths
never see each other's or padded keys, and greedy results equal running each request alone.

One request's life: prefill(prompt) → logits → codebook 0 → predictor → frame 1 (first step);
then each step feeds the frame's summed 16 code embeddings plus the next trailing text embedding
(or tts_pad) to the talker at the next position → codebook 0 → EOS ends it ("stop", no codes),
otherwise the predictor completes the frame.

A request whose prompt has an open `TextFeed` (text still arriving) takes the feed's new
embeddings before each step and does not step while the feed has no text for its next input
(`TextFeed.ready`); it keeps its slot and waits. Its frame cap and default length come from the
whole text once the feed closes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from qtts.model.prompt import TalkerPrompt
from qtts.model.sampling import SamplingParams, choose_codebook0, choose_residual_batch, make_generator
from qtts.model.step_output import SAMPLING_FAILED, StepOutput
from qtts.model.text_feed import TextFeed

__all__ = ["SAMPLING_FAILED", "EagerGenerator", "StepOutput"]


@dataclass
class _Request:
    request_id: str
    prompt: TalkerPrompt
    sampling: SamplingParams
    max_new_frames: int | None
    generator: torch.Generator
    slot: int = -1
    length: int = 0  # cache positions written
    frames: int = 0
    history: list[int] = field(default_factory=list)  # codebook-0 tokens generated
    next_embed: torch.Tensor | None = None  # [H] talker input of the next step
    # Text appended while it runs (None: a whole text); chunks of it taken so far.
    feed: TextFeed | None = None
    chunks_taken: int = 0
    trailing: torch.Tensor | None = None  # [N, H] the prompt's trailing text plus what was taken
    max_frames: float = math.inf  # the text's frame cap (unknown while the text is open)

    def text_ready(self) -> bool:
        """The text the next step feeds is here (always, for a whole text)."""
        return self.feed is None or self.trailing.shape[0] > self.frames


class EagerGenerator:
    """Continuous batching in eager PyTorch (reference engine; the GPU engine builds on the same modules)."""

    def __init__(self, bundle, max_batch: int = 64, initial_capacity: int = 256):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.bundle = bundle
        self.talker = bundle.talker
        self.predictor = bundle.code_predictor
        self.cfg = bundle.config.talker
        self.max_batch = max_batch
        self.device = bundle.device
        self.dtype = bundle.dtype
        self.cache = self.talker.allocate_cache(max_batch, initial_capacity, self.device, self.dtype)
        self.free_slots = list(range(max_batch - 1, -1, -1))
        self.waiting: OrderedDict[str, _Request] = OrderedDict()
        self.active: OrderedDict[str, _Request] = OrderedDict()
        self._open_text: dict[str, _Request] = {}  # requests whose text feed is still open
        self.suppress_mask = torch.zeros(self.cfg.vocab_size, dtype=torch.bool, device=self.device)
        self.suppress_mask[self.cfg.suppressed_ids] = True

    # -- public API ------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Requests admitted and not finished (running or waiting for their prefill)."""
        return len(self.active) + len(self.waiting)

    def add(
        self,
        request_id: str,
        prompt: TalkerPrompt,
        sampling: SamplingParams,
        max_new_frames: int | None = None,
    ) -> None:
        if request_id in self.active or request_id in self.waiting:
            raise ValueError(f"request {request_id!r} is already running")
        if max_new_frames is not None and max_new_frames < 1:
            raise ValueError("max_new_frames must be >= 1")
        sampling.validate()
        feed = getattr(prompt, "text_feed", None)
        if max_new_frames is None and feed is None:
            max_new_frames = getattr(prompt, "default_max_frames", None)
        self.waiting[request_id] = _Request(
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            max_new_frames=max_new_frames,
            generator=make_generator(sampling.seed, self.device),
            feed=feed,
            trailing=prompt.trailing,
            max_frames=math.inf if feed is not None else prompt.max_frames,
        )
        if feed is not None:
            self._open_text[request_id] = self.waiting[request_id]

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its KV slot; False if it is unknown (or already finished)."""
        self._open_text.pop(request_id, None)
        if self.waiting.pop(request_id, None) is not None:
            return True
        req = self.active.pop(request_id, None)
        if req is None:
            return False
        self.free_slots.append(req.slot)
        return True

    @torch.inference_mode()
    def step(self, skip: Collection[str] = ()) -> list[StepOutput]:
        """Prefill newly added requests (as many as there are free slots) and produce one frame
        for every running request. Requests named in `skip` (e.g. no downstream credit) neither
        advance nor sample this step; they keep their KV slot (or their place in the queue), as do
        requests whose open text has nothing for their next input yet."""
        rows: list[_Request] = []
        hiddens: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        if self._open_text:
            skip = set(skip) | self._take_text()
        running = [r for r in self.active.values() if r.next_embed is not None and r.request_id not in skip]
        if running:
            h, lg = self._decode(running)
            rows += running
            hiddens.append(h)
            logits.append(lg)
        joining = []
        for rid in [rid for rid in self.waiting if rid not in skip]:
            if not self.free_slots:
                break
            req = self.waiting.pop(rid)
            req.slot = self.free_slots.pop()
            self.active[req.request_id] = req
            joining.append(req)
        if joining:
            h, lg = self._prefill(joining)
            rows += joining
            hiddens.append(h)
            logits.append(lg)
        if not rows:
            return []
        hidden = torch.cat(hiddens)
        logit = torch.cat(logits)
        return self._finish_frames(rows, hidden, logit)

    # -- internals -------------------------------------------------------------------------
    def _take_text(self) -> set[str]:
        """Take the open feeds' new text; the ids of requests still waiting for theirs."""
        waiting = set()
        for rid, r in list(self._open_text.items()):
            chunks, closed = r.feed.chunks_from(r.chunks_taken)
            if chunks:
                r.trailing = torch.cat(
                    [r.trailing, *(c.to(r.trailing.device, r.trailing.dtype) for c in chunks)]
                )
                r.chunks_taken += len(chunks)
            if closed:
                # Bounded by the whole text now, as a whole-text request is from the start.
                del self._open_text[rid]
                r.max_frames = r.feed.max_frames
                if r.max_new_frames is None:
                    r.max_new_frames = r.feed.default_max_frames
                r.feed = None
            elif not r.text_ready():
                waiting.add(rid)
        return waiting

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.cache.capacity:
            cap = self.cache.capacity
            while cap < needed:
                cap *= 2
            self.cache.grow(cap)

    def _prefill(self, reqs: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = [r.prompt.embeds.shape[0] for r in reqs]
        t = max(lengths)
        self._ensure_capacity(t)
        hsz = self.talker.hidden_size
        x = torch.zeros((len(reqs), t, hsz), device=self.device, dtype=self.dtype)
        for i, r in enumerate(reqs):
            x[i, : lengths[i]] = r.prompt.embeds.to(self.device, self.dtype)
        # Right padding: a padded token of row i sits at positions >= its length, which the row's
        # own later tokens overwrite before they can attend to them.
        positions = torch.arange(t, device=self.device).expand(len(reqs), t)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        hidden, logits = self.talker(x, positions, slots, self.cache, span=t)
        last = torch.tensor(lengths, device=self.device) - 1
        idx = torch.arange(len(reqs), device=self.device)
        for r, n in zip(reqs, lengths, strict=True):
            r.length = n
        return hidden[idx, last], logits[idx, last]

    def _decode(self, reqs: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
        span = max(r.length for r in reqs) + 1
        self._ensure_capacity(span)
        x = torch.stack([r.next_embed for r in reqs])[:, None]
        positions = torch.tensor([[r.length] for r in reqs], device=self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        hidden, logits = self.talker(x, positions, slots, self.cache, span=span)
        for r in reqs:
            r.length += 1
        return hidden[:, 0], logits[:, 0]

    def _release(self, req: _Request) -> None:
        self.active.pop(req.request_id, None)
        self._open_text.pop(req.request_id, None)
        self.free_slots.append(req.slot)

    def _finish_frames(
        self, rows: list[_Request], hidden: torch.Tensor, logits: torch.Tensor
    ) -> list[StepOutput]:
        """A step's outputs: codebook 0 per row, then the other 15 of the rows that go on."""
        outputs, keep, c0 = self._choose_first_codes(rows, hidden, logits)
        if not keep:
            return outputs
        kept = [rows[i] for i in keep]
        c0_t = torch.tensor(c0, dtype=torch.long, device=self.device)
        c0_embed = self.talker.embed_codec(c0_t)

        params = [r.sampling for r in kept]
        generators = [r.generator for r in kept]

        def choose(j: int, lg: torch.Tensor) -> torch.Tensor:
            return choose_residual_batch(lg, params, generators)

        residual = self.predictor(hidden[keep], c0_embed, choose)  # [B, 15]
        frames = torch.cat([c0_t[:, None], residual], dim=1)  # [B, 16]
        frame_sum = c0_embed + self.predictor.embed_codes(residual).sum(1)
        outputs.extend(self._hand_on_frames(kept, frames.cpu(), frame_sum))
        return outputs

    def _choose_first_codes(
        self, rows: list[_Request], hidden: torch.Tensor, logits: torch.Tensor
    ) -> tuple[list[StepOutput], list[int], list[int]]:
        """Each row's codebook-0 token: (outputs of the rows that ended here, on end of speech or a
        failed sampling, the indices of the rows that go on, and their tokens)."""
        eos = self.cfg.codec_eos_id
        outputs: list[StepOutput] = []
        keep: list[int] = []
        c0: list[int] = []
        # A row whose hidden state or logits are not finite would give its predictor NaN logits
        # (torch.multinomial then fails the whole step): it ends here, alone.
        finite = (
            torch.isfinite(hidden).all(dim=-1) & ~(logits.isnan() | (logits == float("inf"))).any(dim=-1)
        ).tolist()
        for i, r in enumerate(rows):
            hist = torch.tensor(r.history, dtype=torch.long, device=self.device) if r.history else None
            try:
                if not finite[i]:
                    raise ValueError("non-finite talker output")
                tok = choose_codebook0(
                    logits[i], r.sampling, hist, len(r.history), eos, self.suppress_mask, r.generator
                )
            except (RuntimeError, ValueError):  # multinomial on NaN / inf probabilities
                self._release(r)
                outputs.append(StepOutput(r.request_id, None, True, SAMPLING_FAILED))
                continue
            r.history.append(tok)
            if tok == eos:
                self._release(r)
                outputs.append(StepOutput(r.request_id, None, True, "stop"))
            else:
                keep.append(i)
                c0.append(tok)
        return outputs, keep, c0

    def _hand_on_frames(
        self, kept: list[_Request], frames_cpu: torch.Tensor, frame_sum: torch.Tensor
    ) -> list[StepOutput]:
        """Each kept row's frame; a row at its length bound ends, the others get their next input."""
        outputs: list[StepOutput] = []
        for b, r in enumerate(kept):
            step = r.frames  # index of this frame's trailing text embedding
            r.frames += 1
            reason = None
            if r.frames >= r.max_frames or (r.max_new_frames is not None and r.frames >= r.max_new_frames):
                # A caller's bound ends as "length" even where the text's cap came first; only an
                # unbounded run into the cap is a failure.
                reason = "frame_cap" if r.max_new_frames is None else "length"
            if reason:
                self._release(r)
                outputs.append(StepOutput(r.request_id, frames_cpu[b], True, reason))
                continue
            trailing = r.trailing
            text = trailing[step] if step < trailing.shape[0] else r.prompt.pad_embed
            r.next_embed = frame_sum[b] + text.to(self.device, self.dtype)
            outputs.append(StepOutput(r.request_id, frames_cpu[b], False, None))
        return outputs
