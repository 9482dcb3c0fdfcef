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
from qtts.model.prompt_key import PrefixHasher, host_bytes, update_holding_gil
from qtts.model.prompt_layout import (  # NeedMoreText: its callers import it from here
    CodecTable,
    NeedMoreText,  # noqa: F401
    PromptLayout,
    icl_layout,
    materialise,
    text_layout,
)
from qtts.model.text_feed import TextFeed
from qtts.model.tokenizer import encode, encode_many
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
        self.codecs = CodecTable(config, self.embed)  # C(.) of the control, language, speaker ids

    def _voice_parts(self, voice) -> tuple[bytes, tuple]:
        """(the voice's digest, (its rows [1 (+ 1 + T), H] on the device: speaker embedding, then
        for ICL C(codec_bos) and the reference frames; transcript ids or None; the prefix key's
        x-vector and reference-code fields)) of a voice prompt, kept by its content."""
        h = hashlib.blake2b(digest_size=16)
        for t in (voice.x_vector, voice.ref_codes):
            if t is not None:
                h.update(f"{t.dtype}{tuple(t.shape)};".encode())
                update_holding_gil(h, host_bytes(t))
        h.update(repr(voice.ref_text).encode())
        digest = h.digest()

        def make() -> tuple:
            dtype = self.talker.codec_head.weight.dtype
            speaker = self.embed.to_device(voice.x_vector, dtype).view(1, -1)
            x_key = PrefixHasher.tensor_raw(voice.x_vector.detach().to("cpu", torch.float32).reshape(-1))
            if voice.ref_codes is None or not voice.ref_text:
                return speaker, None, x_key, None
            ref_codes = self.embed.to_device(voice.ref_codes, torch.long)
            bos = self.embed.codec([self.config.talker.codec_bos_id])[0]
            rows = torch.cat([speaker, bos, self.embed.frames(ref_codes)])
            ref_ids = encode(self.tokenizer, ref_text_block(voice.ref_text))[3:-2]
            codes_key = PrefixHasher.tensor_raw(voice.ref_codes.detach().to("cpu", torch.long))
            return rows, ref_ids, x_key, codes_key

        return digest, self.embed.remember(("voice", digest), make)

    def text_embeds(self, ids: list[int]) -> torch.Tensor:
        """Projected text embeddings [len(ids), H] (trailing text appended to a running request)."""
        return self.embed.text(ids)[0]

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
    def build(self, spec: SynthesisSpec) -> TalkerPrompt:
        (result,) = self.build_many([spec])
        if isinstance(result, Exception):
            raise result
        return result

    @torch.no_grad()
    def build_many(self, specs: list[SynthesisSpec]) -> list[TalkerPrompt | Exception]:
        """The prompt of each spec, or the error that refuses it: laid out one by one on the host,
        summed together on the device (`prompt_layout`). A device error raises for all."""
        out: list[TalkerPrompt | Exception] = []
        layouts = []
        try:  # every target text in one tokenizer call
            encoded = encode_many(self.tokenizer, [assistant_text(s.text) for s in specs])
        except Exception:  # noqa: BLE001 - e.g. a text the tokenizer refuses: each spec on its own
            encoded = [None] * len(specs)
        for spec, ids in zip(specs, encoded, strict=True):
            try:
                layouts.append(self.layout(spec, ids))
                out.append(None)  # type: ignore[arg-type] - filled in below
            except Exception as exc:  # noqa: BLE001 - this spec's error, the rest go on
                out.append(exc)
        if not layouts:
            return out
        pad = self._pad_embed()
        summed = iter(materialise(layouts, self.codecs, self.embed))
        lays = iter(layouts)
        for i, value in enumerate(out):
            if value is None:
                embeds, trailing = next(summed)
                out[i] = TalkerPrompt(embeds=embeds, trailing=trailing, pad_embed=pad, **next(lays).meta)
        return out

    def _pad_embed(self) -> torch.Tensor:
        """T(tts_pad) [H], computed once."""
        pad = getattr(self, "_pad", None)
        if pad is None:
            pad = self._pad = self.embed.text([self.config.tts_pad_id])[0, 0]
        return pad

    def layout(self, spec: SynthesisSpec, ids: list[int] | None = None) -> PromptLayout:
        """The prompt of `spec` as text ids and codec rows (DESIGN.md section 3), laid out exactly
        as the official `generate` sums its embeddings (`ids`: its `assistant_text` tokenised,
        when the caller has them); raises what refuses the spec."""
        self._check_served(spec)
        cfg, tcfg, codecs = self.config, self.config.talker, self.codecs
        voice = spec.voice_prompt
        speaker, speaker_row, voice_key, parts = self._voice_side(spec)
        instruct = spec.instruct or None
        if spec.task == "voice_clone" or (spec.task == "custom_voice" and not cfg.supports_instruct):
            instruct = None
        icl = spec.task == "voice_clone" and not voice.x_vector_only and voice.ref_codes is not None
        if icl and not voice.ref_text:
            raise InvalidArgument("ICL voice clone needs the reference transcript")
        streaming = self._streaming_text(spec)
        open_ = spec.text_open

        if ids is None:
            ids = encode(self.tokenizer, assistant_text(spec.text))
        target = ids[3:-5]
        if not target:
            raise InvalidArgument("text has no tokens")
        lang_id = self.language_id(spec.language, speaker)
        if lang_id is None:
            prefix = [tcfg.codec_nothink_id, tcfg.codec_think_bos_id, tcfg.codec_think_eos_id]
        else:
            prefix = [tcfg.codec_think_id, tcfg.codec_think_bos_id, lang_id, tcfg.codec_think_eos_id]
        speaker_rows = [] if speaker_row is None else [speaker_row]
        codec = codecs.rows(prefix) + speaker_rows + codecs.rows([tcfg.codec_pad_id, tcfg.codec_bos_id])

        key = self._prefix_key(spec, prefix, speaker, parts)
        text_ids: list[int] = []
        if instruct:
            instruct_ids = encode(self.tokenizer, instruct_text(instruct))
            key.add("instruct", instruct_ids)
            text_ids += instruct_ids
        else:
            key.add("instruct", None)
        # The role's tokens come from the target's tokenisation: a text that starts with a newline
        # merges into the role's "\n" token, so the key takes the ids actually used.
        key.add("role", ids[:3])
        text_ids += ids[:3]
        codec_rows = [0] * len(text_ids) + codec[:-1]  # instruct and role: text only
        text_ids += [cfg.tts_pad_id] * (len(codec) - 2) + [cfg.tts_bos_id]
        num_head = len(text_ids)

        num_voice_body = 0  # leading body positions that depend on the voice only
        if icl:
            trailing, num_voice_body = icl_layout(
                cfg, codecs, voice, parts, target, streaming, open_, key, text_ids, codec_rows
            )
        else:
            trailing = text_layout(cfg, codecs, ids, target, codec, streaming, open_, text_ids, codec_rows)
        prefix_len = min(num_head + num_voice_body, len(text_ids))
        cap, default_max = self.text_bounds(len(target))
        meta = dict(
            ref_codes=_long_on_host(voice.ref_codes) if icl else None,
            max_frames=cap,
            num_text_tokens=len(target),
            prefix_key=key.hexdigest() if prefix_len >= MIN_CACHED_PREFIX else None,
            prefix_len=prefix_len,
            default_max_frames=default_max,
            text_feed=TextFeed(len(trailing)) if open_ else None,
        )
        rows = parts[0] if parts is not None else None
        return PromptLayout(text_ids, codec_rows, trailing, voice_key, rows, meta)

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

    def _voice_side(self, spec: SynthesisSpec) -> tuple[str | None, int | None, bytes | None, tuple | None]:
        """(preset speaker, its codec row, the voice's digest, the voice's parts) of a spec: a
        preset speaker's C(id) for CustomVoice, the voice prompt's x-vector for voice clone."""
        tcfg = self.config.talker
        if spec.task == "custom_voice":
            if not spec.speaker:
                return None, None, None, None
            speaker = spec.speaker.lower()
            if speaker not in tcfg.speaker_ids:
                raise InvalidArgument(
                    f"unknown speaker {spec.speaker!r}; supported: {sorted(tcfg.speaker_ids)}"
                )
            return speaker, self.codecs.row(tcfg.speaker_ids[speaker]), None, None
        if spec.task == "voice_clone":
            if spec.voice_prompt is None:
                raise InvalidArgument("voice clone needs a voice prompt")
            digest, parts = self._voice_parts(spec.voice_prompt)
            return None, self.codecs.voice_base, digest, parts
        return None, None, None, None

    @staticmethod
    def _streaming_text(spec: SynthesisSpec) -> bool:
        """Whether the prompt streams its text in (one token per frame) or holds it whole."""
        streaming = spec.streaming_text
        if streaming is None:
            streaming = spec.task == "voice_clone" or spec.text_open
        if spec.text_open and not streaming:
            raise InvalidArgument("text streamed in needs the streaming-text prompt (streaming_text)")
        return streaming

    def _prefix_key(
        self, spec: SynthesisSpec, prefix: list[int], speaker: str | None, parts: tuple | None
    ) -> PrefixHasher:
        """The key's first fields: everything that shapes the positions before the body."""
        cfg, tcfg = self.config, self.config.talker
        key = PrefixHasher()
        key.add("model", f"{cfg.tts_model_type}/{cfg.tts_model_size}/{self.model_name or ''}")
        key.add("hidden", int(self.talker.codec_head.weight.shape[1]))
        key.add("codec_prefix", prefix)
        if spec.task == "custom_voice":
            key.add("speaker", tcfg.speaker_ids[speaker] if speaker else None)
        elif spec.task == "voice_clone":
            key.add_raw("x_vector", parts[2])
        return key


def _long_on_host(t: torch.Tensor) -> torch.Tensor:
    """`t` as int64 on the host (itself when it is already)."""
    if t.dtype == torch.long and t.device.type == "cpu":
        return t
    return t.to("cpu", torch.long)
