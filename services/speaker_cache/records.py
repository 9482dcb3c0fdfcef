"""What speaker_cache stores: voice prompts and named voices, as plain records (no protobuf)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from qtts.request.errors import InvalidArgument

# Voice names appear in URLs and Redis keys: keep them to a safe, readable alphabet.
VOICE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PROMPT_KEY_RE = re.compile(r"^[A-Za-z0-9._:-]{1,256}$")
CONSENT_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_CONSENTS_PAGE = 100


@dataclass(frozen=True)
class PromptRecord:
    """A computed voice prompt: x-vector (float32 LE), reference codes (int16 LE), reference text."""

    model_id: str
    x_vector_f32: bytes
    x_vector_dim: int
    reference_codes_i16: bytes = b""
    num_reference_frames: int = 0
    num_codebooks: int = 0
    reference_text: str = ""
    x_vector_only: bool = False

    @property
    def nbytes(self) -> int:
        return len(self.x_vector_f32) + len(self.reference_codes_i16) + len(self.reference_text) + 64

    def validate(self) -> PromptRecord:
        """Raise `InvalidArgument` when the byte sizes disagree with the declared shapes."""
        if self.x_vector_dim <= 0 or len(self.x_vector_f32) != 4 * self.x_vector_dim:
            raise InvalidArgument(
                f"x_vector_f32 has {len(self.x_vector_f32)} bytes, expected 4 * x_vector_dim "
                f"({self.x_vector_dim}) > 0"
            )
        expected = 2 * self.num_reference_frames * self.num_codebooks
        if len(self.reference_codes_i16) != expected:
            raise InvalidArgument(
                f"reference_codes_i16 has {len(self.reference_codes_i16)} bytes, expected "
                f"2 * {self.num_reference_frames} frames * {self.num_codebooks} codebooks = {expected}"
            )
        return self


@dataclass(frozen=True)
class VoiceRecord:
    """A named voice: the reference clip (float32 LE mono PCM) and how to clone it."""

    name: str
    reference_pcm_f32: bytes
    sample_rate_hz: int
    reference_text: str = ""
    x_vector_only: bool = False
    created_unix_s: int = 0
    # Samples in the clip where the audio is left out (listings); derived from the audio, never stored.
    num_samples: int = 0

    @property
    def samples(self) -> int:
        return len(self.reference_pcm_f32) // 4 if self.reference_pcm_f32 else self.num_samples

    def without_audio(self) -> VoiceRecord:
        return dataclasses.replace(self, reference_pcm_f32=b"", num_samples=self.samples)

    def validate(self, max_audio_bytes: int) -> VoiceRecord:
        validate_voice_name(self.name)
        n = len(self.reference_pcm_f32)
        if n == 0 or n % 4:
            raise InvalidArgument(
                f"voice {self.name!r}: reference_pcm_f32 must be non-empty float32 samples, got {n} bytes"
            )
        if n > max_audio_bytes:
            raise InvalidArgument(
                f"voice {self.name!r}: reference audio is {n} bytes, the limit is {max_audio_bytes}"
            )
        if self.sample_rate_hz <= 0:
            raise InvalidArgument(f"voice {self.name!r}: sample_rate_hz must be > 0")
        if not self.x_vector_only and not self.reference_text.strip():
            raise InvalidArgument(
                f"voice {self.name!r}: reference_text is required unless x_vector_only is set"
            )
        return self


@dataclass(frozen=True)
class ConsentRecord:
    """A voice consent: who agreed, in which language, when, and the recording's hash and size."""

    id: str
    name: str
    language: str
    created_unix_s: int = 0
    recording_sha256: str = ""
    recording_bytes: int = 0

    def validate(self) -> ConsentRecord:
        validate_consent_id(self.id)
        if not self.name.strip() or not self.language.strip():
            raise InvalidArgument(f"consent {self.id!r}: name and language are required")
        return self


def validate_consent_id(consent_id: str) -> str:
    if not CONSENT_ID_RE.match(consent_id or ""):
        raise InvalidArgument(f"invalid consent id {consent_id!r}: 1-64 characters from A-Z a-z 0-9 _ -")
    return consent_id


def validate_voice_name(name: str) -> str:
    if not VOICE_NAME_RE.match(name or ""):
        raise InvalidArgument(
            f"invalid voice name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def validate_prompt_key(key: str) -> str:
    if not PROMPT_KEY_RE.match(key or ""):
        raise InvalidArgument(
            f"invalid voice prompt key {key!r}: use 1-256 characters from A-Z a-z 0-9 . _ : -"
        )
    return key
