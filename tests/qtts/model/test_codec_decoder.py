"""Speech-tokenizer decoder against the official 12 Hz tokenizer (tiny random weights, real layout)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qtts.model.codec_decoder import SpeechTokenizerConfig, load_codec_decoder
from tests.official import import_qwen_tts


@pytest.fixture(scope="module")
def snapshot(tiny_codec_dir) -> Path:
    return tiny_codec_dir


@pytest.fixture(scope="module")
def official_tokenizer(snapshot):
    qwen_tts = import_qwen_tts()
    return qwen_tts.Qwen3TTSTokenizer.from_pretrained(str(snapshot / "speech_tokenizer"))


def _codes(t: int, b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2048, (b, t, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.reference
@pytest.mark.parametrize("frames", [1, 20, 90])  # 90 crosses the 72-frame attention window
def test_decode_matches_official(snapshot, official_tokenizer, frames):
    decoder = load_codec_decoder(snapshot)
    codes = _codes(frames, b=2, seed=frames)
    ours = decoder.decode(codes)
    assert ours.shape == (2, frames * 1920)
    wavs, sr = official_tokenizer.decode([{"audio_codes": c} for c in codes])
    assert sr == 24000
    for ref, got in zip(wavs, ours, strict=True):
        assert ref.shape == (frames * 1920,)
        np.testing.assert_allclose(got.numpy(), ref, atol=1e-4, rtol=0)
    # The random weights must exercise the network, not collapse to silence or a clamped square.
    assert 0.05 < ours.std().item() < 0.8
    assert (ours.abs() >= 1.0).float().mean().item() < 0.05


def test_unbatched_codes_and_empty(snapshot):
    decoder = load_codec_decoder(snapshot)
    codes = _codes(3)
    torch.testing.assert_close(decoder.decode(codes[0]), decoder.decode(codes)[0])
    assert decoder.decode(codes[:, :0]).shape == (1, 0)
    with pytest.raises(ValueError, match="16 codebooks"):
        decoder.decode(codes[..., :8])


def test_loads_speech_tokenizer_folder_directly(snapshot):
    a = load_codec_decoder(snapshot).decode(_codes(2))
    b = load_codec_decoder(snapshot / "speech_tokenizer").decode(_codes(2))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_strict_state_dict(tmp_path, snapshot):
    folder = tmp_path / "speech_tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text((snapshot / "speech_tokenizer" / "config.json").read_text())
    weights = load_file(str(snapshot / "speech_tokenizer" / "model.safetensors"))
    weights.pop("decoder.pre_conv.conv.weight")
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(RuntimeError, match="pre_conv.conv.weight"):
        load_codec_decoder(tmp_path)


def test_rejects_folder_without_speech_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}))
    with pytest.raises(ValueError, match="speech tokenizer"):
        load_codec_decoder(tmp_path)


def test_shipped_full_size_config():
    root = Path(__file__).resolve().parents[3] / "configs" / "speech_tokenizer"
    cfg = SpeechTokenizerConfig.load(root)
    dec = cfg.decoder
    assert (dec.codebook_size, dec.num_quantizers, dec.sliding_window) == (2048, 16, 72)
    assert (dec.hidden_size, dec.latent_dim, dec.decoder_dim, dec.num_hidden_layers) == (512, 1024, 1536, 8)
    assert dec.samples_per_frame == cfg.decode_upsample_rate == 1920
    assert cfg.encoder_valid_num_quantizers == 16 and cfg.encoder["num_quantizers"] == 32
    assert json.loads((root / "preprocessor_config.json").read_text())["sampling_rate"] == 24000


@pytest.mark.reference
def test_incremental_icl_output_matches_official_cut(snapshot, official_tokenizer):
    """The official voice-clone path decodes reference + generated frames and cuts
    int(ref_len / total_len * len(wav)) samples; our incremental stream must return the rest."""
    from qtts.model.incremental import IncrementalDecoder

    decoder = load_codec_decoder(snapshot)
    ref, new = _codes(12, seed=5)[0], _codes(9, seed=6)[0]
    (wav,), _ = official_tokenizer.decode([{"audio_codes": torch.cat([ref, new])}])
    cut = int(12 / 21 * wav.shape[0])
    inc = IncrementalDecoder(decoder)
    state = inc.start(ref)
    ours = torch.cat([inc.decode(state, new[i : i + 2]) for i in range(0, 9, 2)])
    assert ours.shape == (wav.shape[0] - cut,)
    np.testing.assert_allclose(ours.numpy(), wav[cut:], atol=1e-4, rtol=0)
