"""The tiny random forced aligner, loaded by us and (where installed) by the official `qwen-asr`."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_aligner_dir(tmp_path_factory):
    from qtts.tiny_model.aligner import build_tiny_aligner_snapshot

    return build_tiny_aligner_snapshot(tmp_path_factory.mktemp("aligner") / "qwen3-forcedaligner-tiny")


@pytest.fixture(scope="session")
def tiny_aligner(tiny_aligner_dir):
    from qtts.model.aligner import load_aligner

    return load_aligner(tiny_aligner_dir)


@pytest.fixture(scope="session")
def official_aligner(tiny_aligner_dir):
    """`qwen_asr.Qwen3ForcedAligner` on the same folder (fp32, CPU, its default SDPA attention).
    nagisa is loaded first our way (`nagisa_module`, off this thread): `qwen_asr` imports it
    itself, which would leave this test process's thread reading subnormal floats as 0."""
    from qtts.model.aligner.words import nagisa_module

    nagisa_module()
    qwen_asr = pytest.importorskip("qwen_asr")
    import torch

    return qwen_asr.Qwen3ForcedAligner.from_pretrained(str(tiny_aligner_dir), dtype=torch.float32)
