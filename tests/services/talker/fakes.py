"""Small stand-ins for the model core and for code2wav, for talker unit and servicer tests."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from qtts.pb import code2wav_pb2, code2wav_pb2_grpc


@dataclass(frozen=True)
class FakeSampling:
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    seed: int | None = None
    greedy: bool = False


@dataclass
class FakePrompt:
    """A prompt whose generation length is fixed: `frames` frames, then `end_reason`."""

    frames: int
    end_reason: str = "stop"
    ref_codes: torch.Tensor | None = None
    step_delay_s: float = 0.0


@dataclass
class FakeSpec:
    text: str
    task: str
    speaker: str | None = None
    language: str = "auto"
    instruct: str | None = None
    voice_prompt: object = None
    streaming_text: bool | None = None


class FakeBundle:
    """What the talker uses of a TalkerBundle; the text says how many frames to generate.

    Text "frames=N" gives N frames; "cap" ends with the frame cap; "slow" makes steps slow.
    """

    def __init__(self, model_type: str = "base"):
        self.info = SimpleNamespace(
            name=f"fake-{model_type}",
            model_type=model_type,
            model_size="0b6",
            speakers={"vivian": 3065, "ryan": 3061} if model_type == "custom_voice" else {},
            languages={"english": 2050, "chinese": 2055},
            num_codebooks=16,
            codebook_size=2048,
            sample_rate=24000,
            samples_per_frame=1920,
        )
        self.generation_defaults = FakeSampling()
        self.compute_calls = 0
        self.specs: list[FakeSpec] = []

    def build_prompt(self, spec: FakeSpec) -> FakePrompt:
        self.specs.append(spec)
        words = dict(w.split("=", 1) for w in spec.text.split() if "=" in w)
        prompt = FakePrompt(frames=int(words.get("frames", 5)))
        if "cap" in spec.text.split():
            prompt.end_reason = "frame_cap"
        if "slow" in spec.text.split():
            prompt.step_delay_s = 0.01
        vp = spec.voice_prompt
        if vp is not None and not vp.x_vector_only:
            prompt.ref_codes = vp.ref_codes
        return prompt

    def compute_voice_prompt(self, pcm: np.ndarray, ref_text: str | None, x_vector_only: bool):
        self.compute_calls += 1
        return SimpleNamespace(
            x_vector=torch.full((8,), float(pcm.mean())),
            ref_codes=None if x_vector_only else torch.arange(3 * 16).reshape(3, 16),
            ref_text=ref_text,
            x_vector_only=x_vector_only,
        )


class FakeGenerator:
    """EagerGenerator's contract on FakePrompts: codes of frame i are all i (mod 2048)."""

    def __init__(self, bundle: object = None, max_batch: int = 64):
        self.max_batch = max_batch
        self._active: dict[str, list] = {}
        self._lock = threading.Lock()
        self.skips: list[set[str]] = []
        self.max_seen_active = 0

    @property
    def num_active(self) -> int:
        return len(self._active)

    def add(self, request_id, prompt, sampling, max_new_frames=None) -> None:
        assert len(self._active) < self.max_batch, "engine exceeded max_batch"
        self._active[request_id] = [prompt, 0, max_new_frames]
        self.max_seen_active = max(self.max_seen_active, len(self._active))

    def cancel(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def step(self, skip=()) -> list:
        skip = set(skip)
        self.skips.append(skip)
        delay = max((p.step_delay_s for p, _, _ in self._active.values()), default=0.0)
        if delay:
            time.sleep(delay)
        outs = []
        for rid, st in list(self._active.items()):
            if rid in skip:
                continue
            prompt, produced, max_new = st
            if produced == prompt.frames:
                del self._active[rid]
                outs.append(
                    SimpleNamespace(
                        request_id=rid, codes=None, finished=True, finish_reason=prompt.end_reason
                    )
                )
                continue
            st[1] += 1
            codes = torch.full((16,), produced % 2048, dtype=torch.long)
            done = max_new is not None and st[1] >= max_new
            if done:
                del self._active[rid]
            outs.append(
                SimpleNamespace(
                    request_id=rid, codes=codes, finished=done, finish_reason="length" if done else None
                )
            )
        return outs


@dataclass
class DecodeLog:
    request_id: str = ""
    prefix_frames: int = 0
    # The chunk plan the talker asked for in StreamStart (0 / empty: the replica's default).
    first_chunk_frames: int = 0
    chunk_frames_ramp: tuple[int, ...] = ()
    frames: list[int] = field(default_factory=list)
    delta_sizes: list[int] = field(default_factory=list)
    # The frame each flushed delta ended at (FrameDelta.flush: decode though the chunk is short).
    flushes: list[int] = field(default_factory=list)
    max_allowed: int = 0
    violations: list[str] = field(default_factory=list)
    acks: list[int] = field(default_factory=list)
    ended: bool = False
    cancelled: bool = False


class FakeCode2Wav(code2wav_pb2_grpc.Code2WavServiceServicer):
    """Decodes frame i to 1920 samples of value codes[0]; grants `window` frames past the acked audio.

    `die_after_frames`: after receiving that many frames of a stream, the handler calls `on_die`
    (e.g. to stop the whole server) and stops answering.
    """

    def __init__(
        self,
        name: str,
        window: int = 4,
        die_after_frames: int | None = None,
        hold: bool = False,
        plan: tuple[int, tuple[int, ...]] | None = None,
        cost: tuple[int, int, float] | None = None,
        cuts_at_flush: bool = True,
    ):
        self.name = name
        # cuts_at_flush: said in the first grant, as the real code2wav does (False: an older one).
        self.cuts_at_flush = cuts_at_flush
        # cost: (decode_frame_ns, decode_call_ns, decode_calls_per_s) published on every grant.
        self.cost = cost
        # plan: (first chunk, ramp) announced in the first grant, as the real code2wav does.
        self.plan = plan
        # hold: grant only the first window, as a decoder that is stuck would.
        self.hold = hold
        self.window = window
        self.live = 0
        self.logs: list[DecodeLog] = []
        self.die_after_frames = die_after_frames
        self.on_die = None

    async def Decode(self, request_iterator, context):  # noqa: N802
        self.live += 1
        log = DecodeLog()
        self.logs.append(log)
        received = 0
        acked_frames = 0
        seq = 0

        def msg(**kw):
            nonlocal seq
            seq += 1
            return code2wav_pb2.DecodeResponse(stream_id="s", sequence_number=seq - 1, **kw)

        def grant(first: bool = False):
            log.max_allowed = max(log.max_allowed, acked_frames + self.window)
            plan = {}
            if first and self.plan is not None:
                plan = {"first_chunk_frames": self.plan[0], "chunk_frames_ramp": list(self.plan[1])}
                plan["cuts_at_flush"] = self.cuts_at_flush
            if self.cost is not None:
                plan.update(
                    zip(("decode_frame_ns", "decode_call_ns", "decode_calls_per_s"), self.cost, strict=True)
                )
            return msg(credit=code2wav_pb2.CreditGrant(frames_allowed_until=log.max_allowed, **plan))

        try:
            async for req in request_iterator:
                kind = req.WhichOneof("event")
                if kind == "start":
                    log.request_id = req.start.request_id
                    log.prefix_frames = req.start.num_prefix_frames
                    log.first_chunk_frames = req.start.first_chunk_frames
                    log.chunk_frames_ramp = tuple(req.start.chunk_frames_ramp)
                    yield grant(first=True)
                elif kind == "frames":
                    d = req.frames
                    if d.first_frame_index != received:
                        log.violations.append(f"non-contiguous {d.first_frame_index} != {received}")
                    if d.first_frame_index + d.num_frames > log.max_allowed:
                        log.violations.append(
                            f"beyond credit {d.first_frame_index + d.num_frames} > {log.max_allowed}"
                        )
                    codes = np.frombuffer(d.codes_i16, dtype="<i2").reshape(d.num_frames, 16)
                    log.frames.extend(int(c) for c in codes[:, 0])
                    log.delta_sizes.append(d.num_frames)
                    received += d.num_frames
                    if d.flush:
                        log.flushes.append(received)
                    if self.die_after_frames is not None and received >= self.die_after_frames:
                        if self.on_die is not None:
                            await self.on_die()
                        await asyncio.sleep(3600)
                    pcm = np.repeat(codes[:, 0].astype("<i2"), 1920)
                    yield msg(
                        audio=code2wav_pb2.AudioOut(
                            pcm_s16le=pcm.tobytes(),
                            num_samples=pcm.size,
                            first_frame_index=d.first_frame_index,
                            num_frames=d.num_frames,
                            decode_ns=1,
                            held_ns=1_000,  # as the real one says how long it held the chunk
                        )
                    )
                elif kind == "ack":
                    log.acks.append(req.ack.samples_delivered)
                    if not self.hold:
                        acked_frames = req.ack.samples_delivered // 1920
                        yield grant()
                elif kind == "end":
                    log.ended = True
                    yield msg(
                        done=code2wav_pb2.StreamDone(
                            num_frames=received,
                            num_samples=received * 1920,
                            replica=self.name,
                        )
                    )
                    return
        finally:
            # However the call stops (client cancel, server stop) without StreamEnd, it was cut short.
            log.cancelled = not log.ended
            self.live -= 1
