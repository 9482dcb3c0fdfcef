"""Talker prompt builder for every mode (CustomVoice, VoiceDesign, Base ICL, Base x-vector only).

Each prompt position is the sum of a text-track embedding T(.) (projected text embedding) and a
codec-track embedding C(.) (talker codec embedding), laid out exactly as the official
`Qwen3TTSForConditionalGeneration.generate` does (DESIGN.md section 3 "Prompt"):

    [instruct block, text only]  <|im_start|>user\\n{instruct}<|im_end|>\\n
    role (text only)             <|im_start|>assistant\\n
    codec prefix                 think/nothink, think_bos, [language], think_eos, [speaker], pad
                                 with tts_pad on the text track, tts_bos on the last one
    body                         streaming text / non-streaming text / ICL

The result is a `TalkerPrompt`: the prefill embeddings, the text embeddings to feed one per
generated frame (`trailing`, then `pad_embed` forever), the ICL reference codes (the decoder's
prefix) and the frame cap derived from the text length.

It also names its reusable prefix: `prefix_len` leading positions whose embeddings depend only on
the model and the voice side of the request (voice prompt or preset speaker, language, instruct,
mode), never on the target text, and `prefix_key`, a sha256 of exactly those inputs, so the engine
can keep their KV once per voice (`qtts.engine.prefix_cache`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from qtts.model.config import ModelConfig
from qtts.model.prompt_embeddings import PromptEmbeddings
from qtts.model.text_feed import TextFeed
from qtts.model.tokenizer import encode
from qtts.request.errors import InvalidArgument
from qtts.request.vocabulary import served_task

# Frame cap: generous against real speech rates (about 3-4 frames of 80 ms per text token; a slow
# instructed voice maybe twice that), so only a request that missed end-of-speech reaches it.
FRAMES_PER_TEXT_TOKEN = 12
FRAME_CAP_MARGIN = 40
# Frames added to a model-declared default length (see `default_length`), so a one-word text
# still gets a short clip.
DEFAULT_LENGTH_MARGIN = 8

# A prefix shorter than this is not worth a cache entry: copying its KV into a slot costs about
# what prefilling it does (a preset speaker or x-vector prompt without instruct has 8-9 positions).
MIN_CACHED_PREFIX = 16
PREFIX_KEY_VERSION = b"qtts-prompt-prefix-v1"


def frame_cap(num_text_tokens: int, limit: int | None = None) -> int:
    """Most frames a request may produce before it is ended as "frame_cap"."""
    cap = FRAME_CAP_MARGIN + FRAMES_PER_TEXT_TOKEN * max(num_text_tokens, 1)
    return min(cap, limit) if limit else cap


def default_length(num_text_tokens: int, frames_per_text_token: float | None, cap: int) -> int | None:
    """The length bound a model declares for callers that give none (None: the model declares none
    and ends by itself, as real checkpoints do). Kept below the text's frame cap, so such a request
    always ends as "length", never as the "frame_cap" failure."""
    if not frames_per_text_token:
        return None
    frames = DEFAULT_LENGTH_MARGIN + math.ceil(frames_per_text_token * max(num_text_tokens, 1))
    return max(1, min(frames, cap))


@dataclass
class VoicePrompt:
    """A Base-model voice: speaker x-vector, and for ICL the reference codes and transcript."""

    x_vector: torch.Tensor  # [H] float32
    ref_codes: torch.Tensor | None  # [T, 16] long (ICL only)
    ref_text: str | None
    x_vector_only: bool


@dataclass
class SynthesisSpec:
    """What to synthesise. `streaming_text=None` means the mode's default (streaming for voice clone,
    non-streaming for CustomVoice / VoiceDesign, as in the official package)."""

    text: str
    task: str  # "voice_clone" | "custom_voice" | "voice_design"
    speaker: str | None = None
    language: str = "auto"
    instruct: str | None = None
    voice_prompt: VoicePrompt | None = None
    streaming_text: bool | None = None
    # More text follows while the request runs (`text` is what is safe to tokenise so far): the
    # prompt gets a `TextFeed` and no `tts_eos` yet. Needs the streaming-text prompt.
    text_open: bool = False


class NeedMoreText(InvalidArgument):
    """A text-open ICL prompt whose text does not yet fill the reference frames: a whole-text
    prompt would pad it with tts_pad, so the prompt waits for more text (or the end of it)."""


@dataclass
class TalkerPrompt:
    """Input of one generation request (see docs/interfaces.md)."""

    embeds: torch.Tensor  # [L, H] prefill input
    trailing: torch.Tensor  # [N, H] text embeddings fed one per generated frame
    pad_embed: torch.Tensor  # [H] fed once `trailing` is used up
    ref_codes: torch.Tensor | None  # [T, 16] decoder prefix (ICL)
    max_frames: int
    num_text_tokens: int
    # Leading positions of `embeds` that depend only on the voice side of the request (not on the
    # target text), and a stable hash of those inputs (None when the prefix is too short to cache).
    prefix_key: str | None = None
    prefix_len: int = 0
    # The bound a request without max_new_frames ends at, as "length" (None: it runs until end of
    # speech, or fails at `max_frames`). Only models that never end speech by themselves (the tiny
    # random snapshots) declare one.
    default_max_frames: int | None = None
    # Text appended while the request runs (`text_open` specs); None for a whole text.
    text_feed: TextFeed | None = None


class _PrefixHasher:
    """sha256 over labelled fields, so that different field splits never collide."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(PREFIX_KEY_VERSION)

    def add(self, label: str, data: bytes | str | int | list[int] | torch.Tensor | None) -> None:
        if data is None:
            raw = b"<none>"
        elif isinstance(data, torch.Tensor):
            head = f"{data.dtype}{tuple(data.shape)}".encode()
            raw = head + data.detach().cpu().contiguous().numpy().tobytes()
        elif isinstance(data, bytes):
            raw = data
        elif isinstance(data, list):
            raw = b",".join(str(int(i)).encode() for i in data)
        else:
            raw = str(data).encode()
        self._h.update(label.encode() + b"\0" + len(raw).to_bytes(8, "little") + raw)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ref_text_block(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


class PromptBuilder:
    """Builds `TalkerPrompt`s from `SynthesisSpec`s with a loaded talker and tokenizer."""

    def __init__(
        self,
        config: ModelConfig,
        talker,
        code_predictor,
        tokenizer,
        frame_limit: int | None = None,
        model_name: str | None = None,
        default_frames_per_text_token: float | None = None,
    ):
        self.config = config
        self.talker = talker
        self.code_predictor = code_predictor
        self.tokenizer = tokenizer
        self.frame_limit = frame_limit
        self.default_frames_per_text_token = default_frames_per_text_token
        self.model_name = model_name  # part of the prefix key (a cache may outlive one model)
        # T(.), C(.) and frame embeddings, those that do not depend on the target text kept.
        self.embed = PromptEmbeddings(talker, code_predictor)

    def _voice_parts(self, voice) -> tuple:
        """(speaker embedding [1, 1, H], reference frames on the device, C(bos) + their embeddings
        [1, T + 1, H] or None, transcript ids or None) of a voice prompt, by its content."""
        h = hashlib.blake2b(digest_size=16)
        for t in (voice.x_vector, voice.ref_codes):
            if t is not None:
                h.update(f"{t.dtype}{tuple(t.shape)};".encode())
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
        h.update(repr(voice.ref_text).encode())

        def make() -> tuple:
            dtype = self.talker.codec_head.weight.dtype
            speaker = self.embed.to_device(voice.x_vector, dtype).view(1, 1, -1)
            if voice.ref_codes is None or not voice.ref_text:
                return speaker, None, None, None
            ref_codes = self.embed.to_device(voice.ref_codes, torch.long)
            codec_embed = torch.cat(
                [self.embed.codec([self.config.talker.codec_bos_id]), self.embed.frames(ref_codes)[None]],
                dim=1,
            )
            ref_ids = encode(self.tokenizer, ref_text_block(voice.ref_text))[3:-2]
            return speaker, ref_codes, codec_embed, ref_ids

        return self.embed.remember(("voice", h.digest()), make)

    def text_embeds(self, ids: list[int]) -> torch.Tensor:
        """Projected text embeddings [len(ids), H] (trailing text appended to a running request)."""
        return self.embed.text(ids)[0] if ids else self.talker.embed_text(self.embed.ids([0]))[0, :0]

    def eos_embed(self) -> torch.Tensor:
        """T(tts_eos) as one trailing position [1, H]."""
        return self.embed.text([self.config.tts_eos_id])[0]

    def role_and_target_ids(self, text: str) -> list[int]:
        """The role's and the target's ids of `text`, as a whole-text prompt tokenises it."""
        return encode(self.tokenizer, assistant_text(text))[:-5]

    def text_ids(self, text: str) -> list[int]:
        """The ids of `text` on its own (text that follows a pre-token boundary of a target)."""
        return encode(self.tokenizer, text)

    def text_bounds(self, num_text_tokens: int) -> tuple[int, int | None]:
        """(frame cap, default length) of a target text of `num_text_tokens` tokens."""
        cap = frame_cap(num_text_tokens, self.frame_limit)
        return cap, default_length(num_text_tokens, self.default_frames_per_text_token, cap)

    def language_id(self, language: str | None, speaker: str | None) -> int | None:
        lang = (language or "auto").lower()
        tcfg = self.config.talker
        if lang == "auto":
            lang_id = None
        elif lang in self.config.languages:
            lang_id = tcfg.language_ids[lang]
        else:
            raise InvalidArgument(
                f"unsupported language {language!r}; supported: {sorted(['auto', *self.config.languages])}"
            )
        if lang in ("chinese", "auto") and speaker:
            dialect = tcfg.speaker_dialects.get(speaker.lower(), False)
            if dialect:
                lang_id = tcfg.language_ids[dialect]
        return lang_id

    # -- the prompt ------------------------------------------------------------------------
    @torch.no_grad()
    def build(self, spec: SynthesisSpec) -> TalkerPrompt:
        self._check_served(spec)
        speaker, speaker_embed, instruct, icl = self._voice_side(spec)
        voice = spec.voice_prompt
        streaming = self._streaming_text(spec)
        open_ = spec.text_open

        ids = encode(self.tokenizer, assistant_text(spec.text))
        target = ids[3:-5]
        if not target:
            raise InvalidArgument("text has no tokens")
        lang_id = self.language_id(spec.language, speaker)

        bos_eos_pad = self.embed.text(
            [self.config.tts_bos_id, self.config.tts_eos_id, self.config.tts_pad_id]
        )
        tts_bos, tts_eos, tts_pad = bos_eos_pad.chunk(3, dim=1)
        prefix, codec = self._codec_prefix(lang_id, speaker_embed)
        n = codec.shape[1]
        head = torch.cat([tts_pad.expand(-1, n - 2, -1), tts_bos], dim=1) + codec[:, :-1]

        key = self._prefix_key(spec, prefix, speaker)
        parts = self._head_parts(instruct, ids[:3], head, key)
        num_head = sum(p.shape[1] for p in parts)

        num_voice_body = 0  # leading body positions that depend on the voice only
        if icl:
            body, trailing, num_voice_body = self._icl_body(
                voice, target, streaming, open_, key, tts_eos, tts_pad
            )
        else:
            body, trailing = self._text_body(ids, target, codec, streaming, open_, tts_eos, tts_pad)
        parts.extend(body)

        embeds = torch.cat(parts, dim=1)[0]
        prefix_len = min(num_head + num_voice_body, int(embeds.shape[0]))
        cap, default_max = self.text_bounds(len(target))
        return TalkerPrompt(
            embeds=embeds,
            trailing=trailing[0],
            pad_embed=tts_pad[0, 0],
            ref_codes=voice.ref_codes.to(torch.long).cpu() if icl else None,
            max_frames=cap,
            num_text_tokens=len(target),
            prefix_key=key.hexdigest() if prefix_len >= MIN_CACHED_PREFIX else None,
            prefix_len=prefix_len,
            default_max_frames=default_max,
            text_feed=TextFeed(int(trailing.shape[1])) if open_ else None,
        )

    def _check_served(self, spec: SynthesisSpec) -> None:
        """The model serves the spec's task, and there is text."""
        cfg = self.config
        expected = served_task(cfg.tts_model_type)
        if spec.task != expected:
            raise InvalidArgument(
                f"task {spec.task!r} is not served by a {cfg.tts_model_type} model (it serves {expected!r})"
            )
        if not spec.text:
            raise InvalidArgument("text must not be empty")

    def _voice_side(self, spec: SynthesisSpec) -> tuple[str | None, torch.Tensor | None, str | None, bool]:
        """(preset speaker, speaker embedding [1, 1, H], instruct, ICL or not) of a spec: a preset
        speaker for CustomVoice, the voice prompt's x-vector for voice clone; instruct only where
        the model takes it (never for voice clone)."""
        tcfg = self.config.talker
        speaker_embed = None
        speaker = None
        instruct = spec.instruct or None
        voice = spec.voice_prompt
        if spec.task == "custom_voice":
            if spec.speaker:
                speaker = spec.speaker.lower()
                if speaker not in tcfg.speaker_ids:
                    raise InvalidArgument(
                        f"unknown speaker {spec.speaker!r}; supported: {sorted(tcfg.speaker_ids)}"
                    )
                speaker_embed = self.embed.codec([tcfg.speaker_ids[speaker]])
            if not self.config.supports_instruct:
                instruct = None
        elif spec.task == "voice_clone":
            if voice is None:
                raise InvalidArgument("voice clone needs a voice prompt")
            speaker_embed = self._voice_parts(voice)[0]
            instruct = None
        icl = spec.task == "voice_clone" and not voice.x_vector_only and voice.ref_codes is not None
        if icl and not voice.ref_text:
            raise InvalidArgument("ICL voice clone needs the reference transcript")
        return speaker, speaker_embed, instruct, icl

    @staticmethod
    def _streaming_text(spec: SynthesisSpec) -> bool:
        """Whether the prompt streams its text in (one token per frame) or holds it whole."""
        streaming = spec.streaming_text
        if streaming is None:
            streaming = spec.task == "voice_clone" or spec.text_open
        if spec.text_open and not streaming:
            raise InvalidArgument("text streamed in needs the streaming-text prompt (streaming_text)")
        return streaming

    def _codec_prefix(
        self, lang_id: int | None, speaker_embed: torch.Tensor | None
    ) -> tuple[list[int], torch.Tensor]:
        """(think ids, the codec track of the prefix: think/nothink, [language], [speaker], pad, bos)."""
        tcfg = self.config.talker
        if lang_id is None:
            prefix = [tcfg.codec_nothink_id, tcfg.codec_think_bos_id, tcfg.codec_think_eos_id]
        else:
            prefix = [tcfg.codec_think_id, tcfg.codec_think_bos_id, lang_id, tcfg.codec_think_eos_id]
        pieces = [self.embed.codec(prefix)]
        if speaker_embed is not None:
            pieces.append(speaker_embed)
        pieces.append(self.embed.codec([tcfg.codec_pad_id, tcfg.codec_bos_id]))
        return prefix, torch.cat(pieces, dim=1)

    def _prefix_key(self, spec: SynthesisSpec, prefix: list[int], speaker: str | None) -> _PrefixHasher:
        """The key's first fields: everything that shapes the positions before the body."""
        cfg, tcfg = self.config, self.config.talker
        key = _PrefixHasher()
        key.add("model", f"{cfg.tts_model_type}/{cfg.tts_model_size}/{self.model_name or ''}")
        key.add("hidden", int(self.talker.codec_head.weight.shape[1]))
        key.add("codec_prefix", prefix)
        if spec.task == "custom_voice":
            key.add("speaker", tcfg.speaker_ids[speaker] if speaker else None)
        elif spec.task == "voice_clone":
            key.add("x_vector", spec.voice_prompt.x_vector.detach().to("cpu", torch.float32).reshape(-1))
        return key

    def _head_parts(
        self, instruct: str | None, role_ids: list[int], head: torch.Tensor, key: _PrefixHasher
    ) -> list[torch.Tensor]:
        """[instruct block], role, codec prefix: the positions before the body (added to `key`)."""
        parts = []
        if instruct:
            instruct_ids = encode(self.tokenizer, instruct_text(instruct))
            key.add("instruct", instruct_ids)
            parts.append(self.embed.text(instruct_ids))
        else:
            key.add("instruct", None)
        # The role's tokens come from the target's tokenisation: a text that starts with a newline
        # merges into the role's "\n" token, so the key takes the ids actually used.
        key.add("role", role_ids)
        parts.append(self.embed.text(role_ids))
        parts.append(head)
        return parts

    def _icl_body(
        self,
        voice: VoicePrompt,
        target: list[int],
        streaming: bool,
        open_: bool,
        key: _PrefixHasher,
        tts_eos: torch.Tensor,
        tts_pad: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        """(body parts, trailing text, leading body positions that depend on the voice only) of an
        ICL prompt; the reference side goes into `key`."""
        _, ref_codes, codec_embed, ref_ids = self._voice_parts(voice)
        # Body position i is T(x_i) + Y_i (streaming) or T(x_i) + C(pad) (non-streaming) with
        # x = ref tokens + target tokens + tts_eos and Y = C(codec_bos), reference frames: the
        # first target token enters at body position len(ref_ids).
        num_voice_body = len(ref_ids)
        key.add("icl_streaming", bool(streaming))
        key.add("ref_text", ref_ids)
        key.add("ref_codes", voice.ref_codes.detach().to("cpu", torch.long))
        text_embed = self.embed.text(ref_ids + target)
        if not open_:
            text_embed = torch.cat([text_embed, tts_eos], dim=1)
        elif text_embed.shape[1] < voice.ref_codes.shape[0] + 1:
            # The whole text might still end inside the reference frames (padded there).
            raise NeedMoreText("the text so far does not reach past the reference frames")
        empty = tts_pad[:, :0]
        tl, cl = text_embed.shape[1], codec_embed.shape[1]
        if not streaming:
            parts = [
                text_embed + self.embed.codec([self.config.talker.codec_pad_id] * tl),
                codec_embed + tts_pad,
            ]
            return parts, empty, num_voice_body
        if tl > cl:
            return [text_embed[:, :cl] + codec_embed], text_embed[:, cl:], num_voice_body
        padded = torch.cat([text_embed, tts_pad.expand(-1, cl - tl, -1)], dim=1)
        return [padded + codec_embed], empty, num_voice_body

    def _text_body(
        self,
        ids: list[int],
        target: list[int],
        codec: torch.Tensor,
        streaming: bool,
        open_: bool,
        tts_eos: torch.Tensor,
        tts_pad: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(body parts, trailing text) of a prompt without reference frames: streaming, the first
        target token on the last codec position and the rest trailing; else the whole text."""
        empty = tts_pad[:, :0]
        if streaming:
            first = self.embed.text(ids[3:4]) + codec[:, -1:]
            rest = self.embed.text(ids[4:-5]) if len(target) > 1 else empty
            return [first], rest if open_ else torch.cat([rest, tts_eos], dim=1)
        body = torch.cat([self.embed.text(target), tts_eos], dim=1)
        parts = [body + self.embed.codec([self.config.talker.codec_pad_id] * body.shape[1])]
        parts.append(tts_pad + self.embed.codec([self.config.talker.codec_bos_id]))
        return parts, empty
