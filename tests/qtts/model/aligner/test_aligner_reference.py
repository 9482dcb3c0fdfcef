"""Our forced aligner against the official `qwen-asr` 0.0.6 on the tiny random snapshot (CPU, fp32):
the same words per language, the same prompt ids, the same logits and the same timestamps."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from qtts.model.aligner import split_words
from qtts.model.aligner.words import repair_timestamps

pytestmark = pytest.mark.reference

# (text, language, sample rate, seconds): the 11 s Chinese clip spans several 1 s conv chunks and
# more than the 8 s attention window of the flash-attention path.
CASES = [
    ("Hello world, it's a test of 12 words.", "English", 24000, 3.05),
    ("你好，世界。今天天气很好 ok", "Chinese", 16000, 11.0),
    ("今日はいい天気ですね。東京へ行きます！", "Japanese", 24000, 2.5),
    ("Guten Tag! Wie geht's dir heute?", "German", 24000, 0.73),
    ("Mixed 中文 and English, 3.5 percent.", "English", 24000, 1.9),
]
SPLIT_TEXTS = {
    "English": ["Hello, world!  It's 12:30 -- we're 100% sure.", "e-mail co-op rock'n'roll", "...!?"],
    "Chinese": ["你好，世界。今天天气很好！", "我有3个apple和两个香蕉。", "「引号」《书名》"],
    "Japanese": [
        "こんにちは、世界。",
        "東京タワーに行きました！今日は晴れです。",
        "カタカナとひらがな、漢字。",
    ],
    "French": ["C'est l'été, n'est-ce pas ?"],
}


def _audio(seconds: float, sr: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    return (
        0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(3 * t)) + 0.05 * rng.standard_normal(t.shape)
    ).astype(np.float32)


@pytest.mark.parametrize("language", sorted(SPLIT_TEXTS))
def test_word_splitting_equals_the_official(official_aligner, language):
    for text in SPLIT_TEXTS[language]:
        words, _ = official_aligner.aligner_processor.encode_timestamp(text, language)
        assert split_words(text, language) == words, text


def test_timestamp_repair_equals_the_official(official_aligner):
    rng = random.Random(0)
    fix = official_aligner.aligner_processor.fix_timestamp
    cases = [[80, 4000, 160, 240], [80, 160, 0, 400], [500, 80, 160], [0, 0, 0, 9, 1, 2, 3, 4, 5, 0, 0, 0]]
    cases += [[rng.randrange(0, 40) * 80.0 for _ in range(rng.randrange(1, 30))] for _ in range(300)]
    for data in cases:
        assert repair_timestamps(data) == fix(np.asarray(data)), data


@pytest.mark.parametrize("case", range(len(CASES)))
def test_prompt_logits_and_timestamps_equal_the_official(tiny_aligner, official_aligner, case):
    text, language, sr, seconds = CASES[case]
    audio = _audio(seconds, sr, seed=case)
    ours = tiny_aligner.prepare(audio, sr, text, language)

    # The official pipeline, step by step as Qwen3ForcedAligner.align runs it.
    from qwen_asr.inference.utils import normalize_audios

    words, prompt = official_aligner.aligner_processor.encode_timestamp(text, language)
    inputs = official_aligner.processor(
        text=[prompt], audio=normalize_audios((audio, sr)), return_tensors="pt", padding=True
    )
    assert ours.words == words
    assert ours.input_ids == inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        want = official_aligner.model.thinker(**inputs).logits
        got = tiny_aligner.net(torch.tensor([ours.input_ids]), [ours.mel])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))

    expected = official_aligner.align((audio, sr), text, language)[0]
    result = tiny_aligner.run([ours])[0]
    assert [(w.word, w.start_s, w.end_s) for w in result] == [
        (i.text, i.start_time, i.end_time) for i in expected
    ]
    # The tiny model's slots differ from each other: this compares timestamps, not one class.
    assert len({w.start_s for w in result} | {w.end_s for w in result}) > 1 or len(result) < 3


def test_a_batch_gives_each_input_its_own_result(tiny_aligner):
    """Right-padded batching changes nothing: each row equals its batch-of-one run."""
    inputs = [
        tiny_aligner.prepare(_audio(seconds, sr, seed=i), sr, text, language)
        for i, (text, language, sr, seconds) in enumerate(CASES)
    ]
    alone = [tiny_aligner.run([x])[0] for x in inputs]
    assert tiny_aligner.run(inputs) == alone
