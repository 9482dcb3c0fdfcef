"""A tiny random talker: the tiny snapshot's config with seeded dummy weights, built in memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qtts.model.bundle import build_modules
from qtts.model.config import ModelConfig
from qtts.model.dummy import init_dummy_weights, materialize
from qtts.tiny_model.snapshot import tiny_config

EOS_BOOST = 5.0  # scales the EOS row of the codec head so that some greedy streams stop early
# float64: batching and chunking change rounding in the last bits (GEMMs of other shapes); in float32
# that can flip a near-tie of a random tiny model's greedy argmax, in float64 practically never.


@pytest.fixture(scope="session")
def tiny_bundle():
    cfg = ModelConfig.from_dict(tiny_config("base"))
    talker, predictor = build_modules(cfg)
    talker = init_dummy_weights(materialize(talker, "cpu", torch.float64), seed=0).eval()
    predictor = init_dummy_weights(materialize(predictor, "cpu", torch.float64), seed=1).eval()
    with torch.no_grad():
        talker.codec_head.weight[cfg.talker.codec_eos_id] *= EOS_BOOST
    return SimpleNamespace(
        talker=talker, code_predictor=predictor, config=cfg, device=torch.device("cpu"), dtype=torch.float64
    )
