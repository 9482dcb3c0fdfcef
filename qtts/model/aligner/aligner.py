"""Word timestamps from audio and its transcript: Qwen3-ForcedAligner end to end.

`ForcedAligner.prepare` turns one (audio, text, language) into an `AlignInput` (the words, the
prompt ids, the log-mel frames), `ForcedAligner.run` aligns a batch of them in one forward pass,
`ForcedAligner.align` does both. Each input is featurised alone, as the official
`Qwen3ForcedAligner.align` does a batch of one: the result of an input never depends on what it
was batched with (the official batch pads the audio before the mel transform, which moves the last
frames of the shorter clips).
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qtts.model.aligner.config import SAMPLE_RATE_HZ, AlignerConfig, AlignerSnapshot, open_aligner_snapshot
from qtts.model.aligner.network import AlignerNet, encoder_output_length
from qtts.model.aligner.words import aligner_text, repair_timestamps, split_words
from qtts.model.snapshot import SnapshotError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WordTiming:
    word: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class AlignInput:
    words: list[str]
    input_ids: list[int]
    mel: torch.Tensor  # [num_mel_bins, frames], float32 on the CPU

    @property
    def audio_seconds(self) -> float:
        return self.mel.shape[1] / 100.0


def resample_to_16k(audio: np.ndarray, sample_rate_hz: int) -> np.ndarray:
    """Mono float32 at 16 kHz in [-1, 1], as the official `normalize_audio_input` makes it
    (librosa's default soxr_hq resampler, the length fixed to ceil(n * ratio), then a peak
    normalisation only for out-of-range input)."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"audio must be mono (one dimension), got shape {audio.shape}")
    if sample_rate_hz != SAMPLE_RATE_HZ:
        import soxr

        n = int(np.ceil(audio.shape[0] * SAMPLE_RATE_HZ / sample_rate_hz))
        out = np.asarray(
            soxr.resample(audio, sample_rate_hz, SAMPLE_RATE_HZ, quality="soxr_hq"), dtype=np.float32
        )
        audio = out[:n] if out.shape[0] >= n else np.pad(out, (0, n - out.shape[0]))
    if audio.size:
        peak = float(np.max(np.abs(audio)))
        if peak > 1.0:
            audio = audio / peak
        audio = np.clip(audio, -1.0, 1.0).astype(np.float32)
    return audio


class ForcedAligner:
    """The loaded aligner: network, tokenizer and feature extractor of one snapshot."""

    def __init__(self, net: AlignerNet, tokenizer, feature_extractor, config: AlignerConfig, name: str):
        self.net = net
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.config = config
        self.name = name
        first = next(net.parameters())
        self.device, self.dtype = first.device, first.dtype

    def prepare(self, audio: np.ndarray, sample_rate_hz: int, text: str, language: str) -> AlignInput:
        """Featurise one input (CPU work: resampling, mel, tokenising). Raises ValueError for
        audio too short to align or text with no word in it."""
        wav = resample_to_16k(audio, sample_rate_hz)
        if wav.shape[0] < self.feature_extractor.n_fft:  # the STFT's reflect padding needs this much
            raise ValueError(
                f"the audio is too short to align (under {self.feature_extractor.n_fft / 16:g} ms)"
            )
        words = split_words(text, language)
        if not words:
            raise ValueError("the text has no word to align (only punctuation or spaces)")
        feats = self.feature_extractor(
            [wav],
            sampling_rate=SAMPLE_RATE_HZ,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        frames = int(feats["attention_mask"].sum())
        mel = feats["input_features"][0, :, :frames].float()
        prompt = aligner_text(words)
        ids = list(self.tokenizer(prompt)["input_ids"])
        pad_id = self.config.audio_token_id
        at = ids.index(pad_id)
        ids = ids[:at] + [pad_id] * encoder_output_length(frames) + ids[at + 1 :]
        return AlignInput(words=words, input_ids=ids, mel=mel)

    @torch.inference_mode()
    def run(self, batch: list[AlignInput]) -> list[list[WordTiming]]:
        """Align a batch in one decoder pass (right-padded prompts)."""
        if not batch:
            return []
        width = max(len(x.input_ids) for x in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x.input_ids)] = torch.tensor(x.input_ids)
        ids = ids.to(self.device)
        logits = self.net(ids, [x.mel.to(self.device) for x in batch])
        classes = logits.argmax(dim=-1).cpu()
        return [self.timings(x, classes[i]) for i, x in enumerate(batch)]

    def timings(self, x: AlignInput, classes: torch.Tensor) -> list[WordTiming]:
        """The words of `x` timed from the timestamp class of each of its positions (a CPU row of
        at least len(x.input_ids); what lies past the prompt is padding)."""
        row = torch.tensor(x.input_ids)
        stamps = classes[: len(x.input_ids)][row == self.config.timestamp_token_id]
        fixed = repair_timestamps((stamps * self.config.timestamp_segment_ms).numpy().tolist())
        return [
            WordTiming(w, round(fixed[2 * j] / 1000.0, 3), round(fixed[2 * j + 1] / 1000.0, 3))
            for j, w in enumerate(x.words)
        ]

    def align(self, audio: np.ndarray, sample_rate_hz: int, text: str, language: str) -> list[WordTiming]:
        return self.run([self.prepare(audio, sample_rate_hz, text, language)])[0]


def _feature_extractor(snap: AlignerSnapshot):
    from transformers import WhisperFeatureExtractor

    pre = snap.folder / "preprocessor_config.json"
    if pre.is_file():
        raw = json.loads(pre.read_text(encoding="utf-8"))
        keys = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value")
        return WhisperFeatureExtractor(**{k: raw[k] for k in keys if k in raw})
    return WhisperFeatureExtractor(feature_size=snap.config.audio.num_mel_bins, sampling_rate=SAMPLE_RATE_HZ)


def _tokenizer(snap: AlignerSnapshot):
    from qtts.model.aligner.tokenizer import write_aligner_tokenizer
    from qtts.model.tokenizer import load_text_tokenizer

    if snap.has_tokenizer:
        return load_text_tokenizer(snap.folder)
    if snap.load_format != "dummy":
        raise SnapshotError(f"{snap.folder}: missing tokenizer files")
    folder = Path(tempfile.mkdtemp(prefix="qtts-aligner-tokenizer-"))
    label = write_aligner_tokenizer(folder)
    log.info("%s has no tokenizer files: the dummy load tokenises with %s", snap.folder, label)
    return load_text_tokenizer(folder, config_folder=snap.folder)


def load_aligner(
    path_or_id: str | Path,
    load_format: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ForcedAligner:
    """Load a forced-aligner snapshot (or, for `load_format="dummy"`, seeded random weights)."""
    from qtts.model.dummy import init_dummy_weights

    snap = open_aligner_snapshot(path_or_id, load_format)
    with torch.device("meta"):
        net = AlignerNet(snap.config)
    net = net.to_empty(device=device)
    if snap.load_format == "dummy":
        init_dummy_weights(net, seed=seed)
    else:
        from safetensors.torch import load_file

        prefix = "thinker."
        sd = {k[len(prefix) :]: v for k, v in load_file(str(snap.folder / "model.safetensors")).items()}
        own = net.state_dict()
        missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        bad = [k for k in own if k in sd and tuple(own[k].shape) != tuple(sd[k].shape)]
        if missing or unexpected or bad:
            raise SnapshotError(
                f"{snap.folder}: aligner weights do not match config.json: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong shape {bad[:5]}"
            )
        net.load_state_dict(sd, strict=True)
    net = net.to(dtype=dtype).eval()
    net.audio_tower.reset_buffers()
    _reset_rotary(net)
    return ForcedAligner(net, _tokenizer(snap), _feature_extractor(snap), snap.config, snap.name)


def _reset_rotary(net: AlignerNet) -> None:
    from qtts.model.dummy import reset_rotary

    reset_rotary(net)
