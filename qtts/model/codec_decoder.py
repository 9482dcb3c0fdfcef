"""Speech-tokenizer decoder of Qwen3-TTS-12Hz: 16 codebooks per 80 ms frame -> 24 kHz waveform.

Every layer is causal, so one code path serves both the full decode and the stateful incremental
decode: each stateful layer reads its history from a cache dict (zeros for a fresh stream, which is
exactly the zero left padding of the full decode) and writes back the history it leaves behind.
Rows of a batch may carry different numbers of valid frames (right-padded); causality keeps the
padding out of every valid output, and the histories are taken at each row's own valid length.

The layers live in `codec_layers`, the settings in `codec_config`; this module assembles the
decoder and loads it (checkpoint or seeded random weights). Its names stay importable from here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from qtts import resources
from qtts.model.codec_config import CodecDecoderConfig, SpeechTokenizerConfig
from qtts.model.codec_layers import (
    CausalConv1d,
    CausalTransConv1d,
    ConvNeXtBlock,
    DecoderBlock,
    FrameTransformer,
    ResidualUnit,
    SlidingAttention,
    SnakeBeta,
    SplitRVQ,
    StreamContext,
)

__all__ = [
    "CausalConv1d",
    "CausalTransConv1d",
    "CodecDecoder",
    "CodecDecoderConfig",
    "ConvNeXtBlock",
    "DecoderBlock",
    "FrameTransformer",
    "ResidualUnit",
    "SlidingAttention",
    "SnakeBeta",
    "SpeechTokenizerConfig",
    "init_dummy_weights",
    "load_codec_decoder",
    "resolve_speech_tokenizer_dir",
]

_REPO_CONFIGS = resources.CONFIGS_DIR


class CodecDecoder(nn.Module):
    """Codes [B, T, 16] -> waveform [B, T*1920] in [-1, 1]; parameter names match `decoder.*`."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.samples_per_frame = cfg.samples_per_frame
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = FrameTransformer(cfg)
        self.upsample = nn.ModuleList(
            [
                nn.ModuleList(
                    [CausalTransConv1d(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)]
                )
                for r in cfg.upsampling_ratios
            ]
        )
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
            + [DecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))]
            + [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)]
        )
        self._stateful = self._assign_keys_and_rates()

    def _assign_keys_and_rates(self) -> list[nn.Module]:
        """Name each stateful layer's cache entry and record its time resolution (steps per frame)."""
        stateful: list[nn.Module] = []
        rate = 1
        for name, mod in self.named_modules():
            if name.startswith("upsample.") and isinstance(mod, CausalTransConv1d):
                rate *= mod.stride
            elif name.startswith("decoder.") and isinstance(mod, CausalTransConv1d):
                rate *= mod.stride
            if isinstance(mod, CausalConv1d | CausalTransConv1d):
                mod.key = name
                # A transposed conv's history is taken from its input, before it upsamples.
                mod.rate = rate // mod.stride if isinstance(mod, CausalTransConv1d) else rate
                if mod.history:
                    stateful.append(mod)
            elif isinstance(mod, SlidingAttention):
                mod.key = name + "."
                stateful.append(mod)
        return stateful

    @property
    def device(self) -> torch.device:
        return self.pre_conv.conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_conv.conv.weight.dtype

    def empty_cache(self, batch: int) -> dict[str, torch.Tensor]:
        """Fresh per-stream history (all zeros), batch-first tensors keyed by layer."""
        cache: dict[str, torch.Tensor] = {}
        for mod in self._stateful:
            cache.update(mod.empty_state(batch, self.device, self.dtype))
        return cache

    def forward_stream(
        self,
        codes: torch.Tensor,
        cache: dict[str, torch.Tensor],
        positions: torch.Tensor,
        lengths: torch.Tensor,
        uniform: bool | None = None,
    ) -> torch.Tensor:
        """Decode right-padded codes [B, L, Q] continuing from `cache` (updated in place).

        `positions[b]` frames were decoded before for row b; `lengths[b]` of the L frames are valid.
        Returns [B, L*spf]; samples past a row's valid length are garbage and must be dropped.
        `uniform` (every row valid over all L frames) may be passed to skip a host sync."""
        if codes.shape[-1] != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} codebooks, got {codes.shape[-1]}")
        if uniform is None:
            uniform = bool((lengths == codes.shape[1]).all())
        ctx = StreamContext(cache=cache, lengths=lengths, positions=positions, uniform=uniform)
        h = self.quantizer.decode(codes.clamp(min=0)).to(self.dtype)
        h = self.pre_conv(h, ctx)
        h = self.pre_transformer(h.transpose(1, 2), ctx).transpose(1, 2)
        for trans, block in self.upsample:
            h = block(trans(h, ctx), ctx)
        for layer in self.decoder:
            h = layer(h) if isinstance(layer, SnakeBeta) else layer(h, ctx)
        return h.clamp(min=-1.0, max=1.0).squeeze(1)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode of codes [B, T, Q] (or [T, Q]) -> waveform [B, T*1920] (or [T*1920])."""
        squeeze = codes.dim() == 2
        if squeeze:
            codes = codes.unsqueeze(0)
        codes = codes.to(self.device)
        b, t, _ = codes.shape
        if t == 0:
            out = torch.zeros(b, 0, device=self.device, dtype=self.dtype)
        else:
            pos = torch.zeros(b, dtype=torch.long, device=self.device)
            lens = torch.full((b,), t, dtype=torch.long, device=self.device)
            out = self.forward_stream(codes, self.empty_cache(b), pos, lens, uniform=True)
        return out[0] if squeeze else out


# ----------------------------------------------------------------------------------------------
# loading


def resolve_speech_tokenizer_dir(path_or_id: str | Path, load_format: str = "auto") -> Path:
    """A snapshot folder, its speech_tokenizer/ folder, a hub id, or (dummy) a shipped config name."""
    p = Path(path_or_id)
    for cand in (p / "speech_tokenizer", p):
        if (cand / "config.json").is_file():
            try:
                if (
                    json.loads((cand / "config.json").read_text()).get("model_type")
                    == "qwen3_tts_tokenizer_12hz"
                ):
                    return cand
            except (OSError, json.JSONDecodeError):
                continue
    if load_format == "dummy":
        # Every variant shares the same codec, so any shipped config name maps to the one codec config.
        return _REPO_CONFIGS / "speech_tokenizer"
    if not p.exists() and "/" in str(path_or_id) and not str(path_or_id).startswith(("/", ".")):
        from huggingface_hub import snapshot_download

        try:
            local = Path(snapshot_download(str(path_or_id), allow_patterns=["speech_tokenizer/*"]))
        except Exception as e:  # offline, unknown repo, no access: all mean "cannot load this id"
            raise ValueError(
                f"{path_or_id} is not a local folder and could not be fetched from the hub: {e}"
            ) from e
        return resolve_speech_tokenizer_dir(local, "auto")
    raise ValueError(f"{path_or_id} holds no Qwen3-TTS 12 Hz speech tokenizer (speech_tokenizer/config.json)")


def init_dummy_weights(module: nn.Module, seed: int = 0) -> None:
    """Seeded random weights with realistic scales (dummy load format and tiny test checkpoints)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "cluster_usage":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif leaf == "embedding_sum":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif leaf in ("alpha", "beta"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif leaf in ("scale", "gamma"):
                p.copy_(0.1 + 0.05 * torch.rand(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if leaf == "weight" else 0.0 * p)
            elif leaf == "bias":
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                # Residual branches start small (as trained ones tend to be) so random weights do
                # not amplify float rounding by orders of magnitude through the 4 decoder blocks.
                gain = 0.2 if ".block." in name and (".conv1." in name or ".conv2." in name) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(max(fan_in, 1)))
        for mod in module.modules():
            if isinstance(mod, CausalTransConv1d):
                # Make each transposed conv map a constant input to a constant output. Otherwise
                # the DC that SnakeBeta always adds comes out as a code-independent periodic
                # pattern that every random-weight waveform shares (real weights have none).
                w, r = mod.conv.weight, mod.stride
                if w.shape[-1] == 2 * r:
                    w[..., r:] = -w[..., :r]
                elif w.shape[-1] == r:
                    w[...] = w[..., :1]
        if isinstance(module, CodecDecoder):
            # Rescale the output conv so random weights give speech-like levels instead of a
            # clamped square wave (the clamp would hide most of the network in tests).
            codes = torch.randint(
                0, module.cfg.codebook_size, (1, 4, module.cfg.num_quantizers), generator=gen
            )
            last = module.decoder[-1].conv
            last.bias.zero_()
            module.decoder[-1].conv.weight.mul_(0.01)
            std = module.decode(codes).std().item()
            last.weight.mul_(0.25 / max(std, 1e-6))


def load_codec_decoder(
    path_or_id: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
) -> CodecDecoder:
    """Build the decoder from a speech tokenizer folder and load `decoder.*` strictly."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}")
    folder = resolve_speech_tokenizer_dir(path_or_id, load_format)
    cfg = SpeechTokenizerConfig.load(folder)
    model = CodecDecoder(cfg.decoder)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        from safetensors.torch import load_file

        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"{folder} has no model.safetensors")
        sd = {k[len("decoder.") :]: v for k, v in load_file(str(weights)).items() if k.startswith("decoder.")}
        model.load_state_dict(sd, strict=True)
    return model.to(device=device, dtype=dtype).eval()
