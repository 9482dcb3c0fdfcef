"""The reference-audio encoders of a Base model (speaker encoder and codec encoder) on their own,
computing voice prompts one clip at a time or several at once.

`TalkerBundle` computes prompts through them in the talker's process; the talker's voice worker
(services/talker/voice_worker.py) loads only these, not the talker LM, in a process of its own.

Several clips go through each encoder in one call only where that leaves every clip's result as
its own call gives it: clips of the same length. Padding a shorter clip changes its result (the
speaker encoder pools statistics over the whole clip and pads its convolutions by reflection;
the codec encoder's downsampling pads the last partial frame by replication, so the last frame's
codes differ), so clips of different lengths go one by one.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qtts.model.prompt import VoicePrompt
from qtts.request.errors import InvalidArgument


@dataclass(frozen=True)
class VoiceClip:
    """One voice to encode: 24 kHz mono float32 PCM, its transcript (ICL), the mode."""

    pcm: np.ndarray
    ref_text: str | None
    x_vector_only: bool


class VoiceEncoders:
    """Speaker encoder (x-vector) and codec encoder (reference codes) of one Base snapshot."""

    def __init__(
        self, name: str, model_type: str, speaker_encoder: Any, codec_encoder: Any, max_batch: int = 16
    ):
        self.name = name
        self.model_type = model_type
        self.speaker_encoder = speaker_encoder
        self.codec_encoder = codec_encoder
        self.max_batch = max(1, max_batch)

    @torch.inference_mode()
    def fingerprint(self) -> str:
        """sha256 hex over the encoders' weights (names, dtypes, shapes, bytes): a voice prompt
        depends on nothing else. A few hundred MB hashed for the full-size Base models; "" for a
        model without encoders."""
        if self.speaker_encoder is None and self.codec_encoder is None:
            return ""
        h = hashlib.sha256()
        for name, module in (
            ("speaker_encoder", self.speaker_encoder),
            ("codec_encoder", self.codec_encoder),
        ):
            if module is None:
                continue
            for key, tensor in sorted(module.state_dict().items()):
                t = tensor.detach().contiguous().cpu()
                h.update(f"{name}.{key}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def _check(self, clip: VoiceClip) -> torch.Tensor:
        """The clip as a 1-D float32 tensor, or InvalidArgument saying what is wrong with it."""
        if self.model_type != "base" or self.speaker_encoder is None:
            raise InvalidArgument(f"{self.name} is not a voice-clone (Base) model")
        wav = torch.as_tensor(np.ascontiguousarray(clip.pcm, dtype=np.float32)).reshape(-1)
        if wav.numel() == 0:
            raise InvalidArgument("reference audio is empty")
        if not clip.x_vector_only and not clip.ref_text:
            raise InvalidArgument("reference text is required for ICL voice cloning (or use x_vector_only)")
        if not clip.x_vector_only and self.codec_encoder is None:
            raise InvalidArgument(f"{self.name} has no codec encoder for ICL voice cloning")
        return wav

    @torch.inference_mode()
    def compute(self, clip: VoiceClip) -> VoicePrompt:
        """The prompt of one clip: speaker x-vector (and for ICL the reference codes)."""
        wav = self._check(clip)
        x_vector = self.speaker_encoder.embed(wav).detach().float().cpu().reshape(-1)
        ref_codes = None
        if not clip.x_vector_only:
            ref_codes = self.codec_encoder.encode(wav).detach().to(torch.long).cpu()
        return _prompt(clip, x_vector, ref_codes)

    @torch.inference_mode()
    def compute_many(self, clips: list[VoiceClip]) -> list[VoicePrompt | Exception]:
        """The prompt of each clip, or the error of that clip alone: clips of one length go
        through each encoder together (at most `max_batch` a call), the rest one by one."""
        results: list[VoicePrompt | Exception | None] = [None] * len(clips)
        groups: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        for i, clip in enumerate(clips):
            try:
                wav = self._check(clip)
            except Exception as exc:  # noqa: BLE001 - this clip's error, the others go on
                results[i] = exc
                continue
            groups[wav.numel()].append((i, wav))
        for members in groups.values():
            for start in range(0, len(members), self.max_batch):
                chunk = members[start : start + self.max_batch]
                try:
                    prompts = self._encode_equal_lengths([clips[i] for i, _ in chunk], [w for _, w in chunk])
                except Exception:  # noqa: BLE001 - one by one, so an error is its clip's alone
                    prompts = [self._compute_or_error(clips[i]) for i, _ in chunk]
                for (i, _), prompt in zip(chunk, prompts, strict=True):
                    results[i] = prompt
        return results  # type: ignore[return-value]

    def _compute_or_error(self, clip: VoiceClip) -> VoicePrompt | Exception:
        try:
            return self.compute(clip)
        except Exception as exc:  # noqa: BLE001 - the clip's error is its result
            return exc

    def _encode_equal_lengths(self, clips: list[VoiceClip], wavs: list[torch.Tensor]) -> list[VoicePrompt]:
        if len(wavs) == 1:
            return [self.compute(clips[0])]
        batch = torch.stack(wavs)
        x_vectors = self.speaker_encoder.embed_batch(batch).detach().float().cpu()
        codes = None
        icl = [i for i, c in enumerate(clips) if not c.x_vector_only]
        if icl:
            codes = self.codec_encoder.encode_batch(batch[icl]).detach().to(torch.long).cpu()
        out = []
        for i, clip in enumerate(clips):
            ref_codes = None if clip.x_vector_only else codes[icl.index(i)].clone()
            out.append(_prompt(clip, x_vectors[i].clone(), ref_codes))
        return out


def _prompt(clip: VoiceClip, x_vector: torch.Tensor, ref_codes: torch.Tensor | None) -> VoicePrompt:
    return VoicePrompt(
        x_vector=x_vector,
        ref_codes=ref_codes,
        ref_text=None if clip.x_vector_only else clip.ref_text,
        x_vector_only=clip.x_vector_only,
    )


def load_voice_encoders(
    path_or_id: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    seed: int = 0,
) -> VoiceEncoders:
    """Only the encoders of a Base snapshot, with the very weights `load_talker_bundle` gives them
    (dummy weights from the same seeds), without loading the talker LM."""
    from qtts.model.bundle import load_encoders
    from qtts.model.snapshot import open_snapshot

    snap = open_snapshot(path_or_id, load_format=load_format)
    if snap.config.tts_model_type != "base":
        raise ValueError(f"{snap.name} is not a voice-clone (Base) model: it has no voice encoders")
    speaker, codec = load_encoders(snap, torch.device(device), dtype, seed)
    return VoiceEncoders(snap.name, snap.config.tts_model_type, speaker, codec)
