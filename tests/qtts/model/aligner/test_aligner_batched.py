"""The bucketed, padded batch path (`BucketedAligner`, what the service runs, captured as CUDA
graphs on a GPU) against the unpadded one (`ForcedAligner.run`, equal to the official aligner):
the same class at every prompt position, so the same timestamps, whatever the batch around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qtts.model.aligner.batched import (
    AUDIO_LADDER,
    LENGTH_LADDER,
    PAST_LADDER_STEP,
    Bucket,
    BucketedAligner,
    batch_size,
    ladder_size,
)

# (seconds, text, language): one chunk shorter than a second (padded here, not in the unpadded
# path), exactly one chunk, several chunks with a short last one, and 11 s of Chinese.
CASES = [
    (0.3, "hi there", "english"),
    (0.73, "Guten Tag! Wie geht's dir heute?", "german"),
    (1.0, "exactly one second", "english"),
    (2.5, "a b c d e f", "english"),
    (3.05, "Hello world, it's a test of 12 words.", "english"),
    (11.0, "你好，世界。今天天气很好 ok", "chinese"),
    (1.42, "Mixed 中文 and English, 3.5 percent.", "english"),
]


def _audio(seconds: float, seed: int, sr: int = 24000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    return (
        0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(3 * t)) + 0.05 * rng.standard_normal(t.shape)
    ).astype(np.float32)


@pytest.fixture(scope="module")
def inputs(tiny_aligner):
    return [tiny_aligner.prepare(_audio(s, i), 24000, text, lang) for i, (s, text, lang) in enumerate(CASES)]


@pytest.fixture(scope="module")
def unpadded(tiny_aligner, inputs):
    return [tiny_aligner.run([x])[0] for x in inputs]


def _classes_unpadded(aligner, x) -> torch.Tensor:
    with torch.inference_mode():
        return aligner.net(torch.tensor([x.input_ids]), [x.mel]).argmax(-1)[0]


@pytest.mark.parametrize("emulate_graphs", [False, True], ids=["eager", "static-buffers"])
def test_every_position_has_the_unpadded_class(tiny_aligner, inputs, emulate_graphs):
    runner = BucketedAligner(tiny_aligner, emulate_graphs=emulate_graphs)
    # The whole mix in one call: several buckets, rows padded to the longest of their bucket.
    for x in inputs:
        want = _classes_unpadded(tiny_aligner, x)
        got = runner.classes([x, *inputs])[0, : len(x.input_ids)]
        assert torch.equal(got, want)


@pytest.mark.parametrize("emulate_graphs", [False, True], ids=["eager", "static-buffers"])
def test_padded_batches_give_the_unpadded_timestamps(tiny_aligner, inputs, unpadded, emulate_graphs):
    runner = BucketedAligner(tiny_aligner, emulate_graphs=emulate_graphs)
    assert runner.run(inputs) == unpadded
    assert runner.run(inputs[::-1]) == unpadded[::-1]
    assert runner.run(inputs, max_batch=2) == unpadded
    assert runner.run([inputs[3]] * 5) == [unpadded[3]] * 5  # a row of padding in a bucket of 8
    assert runner.run([]) == []


def test_a_bucket_is_captured_once_and_replayed(tiny_aligner, inputs, unpadded):
    runner = BucketedAligner(tiny_aligner, emulate_graphs=True)
    short = [inputs[0], inputs[3]]
    assert runner.run(short) == [unpadded[0], unpadded[3]]
    first = runner.captured()
    assert first == sorted({runner.bucket([short[i] for i in g]) for g in runner.groups(short)})
    # Other inputs of the same buckets replay the captured graphs: nothing new is captured.
    assert runner.run(short[::-1]) == [unpadded[3], unpadded[0]]
    assert runner.captured() == first
    # No graph past max_graphs, and none on the CPU unless emulated: the eager path answers.
    capped = BucketedAligner(tiny_aligner, emulate_graphs=True, max_graphs=0)
    assert capped.run(inputs) == unpadded and capped.captured() == []
    assert BucketedAligner(tiny_aligner).graphs_on is False


def test_a_prompt_past_the_graph_limit_runs_eagerly(tiny_aligner, inputs, unpadded):
    runner = BucketedAligner(tiny_aligner, emulate_graphs=True, graph_max_length=64)
    long = inputs[5]  # 11 s: more than 64 prompt positions
    assert not runner.graphable(runner.bucket([long]))
    assert runner.run([long, inputs[0]]) == [unpadded[5], unpadded[0]]
    assert all(b.length <= 64 for b in runner.captured())


def test_bucket_sizes():
    assert [ladder_size(n, LENGTH_LADDER) for n in (1, 32, 33, 2048)] == [32, 32, 64, 2048]
    assert ladder_size(2049, LENGTH_LADDER) == 5 * PAST_LADDER_STEP
    assert ladder_size(AUDIO_LADDER[-1] + 1, AUDIO_LADDER) % PAST_LADDER_STEP == 0
    assert [batch_size(n) for n in (1, 2, 3, 5, 8, 9, 128)] == [1, 2, 4, 8, 8, 16, 128]


def test_packing_puts_each_embedding_at_its_slot(tiny_aligner, inputs):
    runner = BucketedAligner(tiny_aligner)
    batch = [inputs[0], inputs[4]]
    bucket = runner.bucket(batch)
    assert bucket == Bucket(2, ladder_size(len(inputs[4].input_ids), LENGTH_LADDER), bucket.audio)
    p = runner.pack(batch, bucket)
    for row, x in enumerate(batch):
        n = runner.audio_tokens(x)
        assert p.input_ids[row, : len(x.input_ids)].tolist() == x.input_ids
        assert int(p.is_audio[row].sum()) == n and int(p.key_mask[row].sum()) == n
        # The audio slots read this row's embeddings 0..n-1, in order.
        assert (p.audio_at[row][p.is_audio[row]] - row * bucket.audio).tolist() == list(range(n))
    # The one-chunk 0.3 s clip keeps only its own convolution outputs; a full chunk keeps all.
    per_row = p.chunks.shape[0] // bucket.batch
    assert p.conv_lens[0].tolist() == [15, 8, 4]
    assert p.conv_lens[per_row].tolist() == [50, 25, 13]


def test_warm_up_captures_every_batch_size_of_each_clip_length(tiny_aligner):
    runner = BucketedAligner(tiny_aligner, emulate_graphs=True)
    assert runner.warm_up([1.0, 4.0], max_batch=6) == len(runner.captured())
    buckets = runner.captured()
    # Batch sizes 1, 2, 4 and 8 (6 rounds up to 8) of each of the two clip lengths.
    assert sorted({b.batch for b in buckets}) == [1, 2, 4, 8]
    assert len({(b.length, b.audio) for b in buckets}) == 2 and len(buckets) == 8
    # On the CPU, no graphs and so nothing to warm.
    assert BucketedAligner(tiny_aligner).warm_up([1.0], max_batch=4) == 0
