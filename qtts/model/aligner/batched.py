"""Batches of alignments in fixed shapes: padded to (batch, length) buckets, one CUDA graph each.

`ForcedAligner.run` runs the audio encoder once per input (its shape is the input's), which at a
batch of 128 is thousands of small kernel launches. `BucketedAligner.run` packs a batch into fixed
shapes instead: B rows (a power of two), prompts right-padded to T positions, audio embeddings to A
per row, mel chunks to ceil(A / 13) per row, from short ladders of sizes. Every index the forward
pass needs (which embedding goes to which prompt slot, which attention keys are real) is a tensor
built here on the CPU, so the pass (`AlignerNet.forward_padded`) has no data-dependent shape. On a
GPU each bucket's pass is captured once as a CUDA graph (all graphs share one memory pool) and
replayed; on the CPU it runs eagerly, and `emulate_graphs` runs the same static-buffer path there.

Inputs of very different lengths do not share a bucket: a batch is sorted by prompt length and cut
where the length bucket changes. Padding changes no real position's result: padded keys are masked
out of the encoder's attention, the decoder's causal mask hides the padding after each prompt, and
a chunk that the unpadded encoder would not pad has its convolution outputs past its end zeroed.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qtts.model.aligner.aligner import AlignInput, ForcedAligner, WordTiming
from qtts.model.aligner.network import _conv_length

log = logging.getLogger(__name__)

LENGTH_LADDER = (32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
AUDIO_LADDER = (16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512, 768, 1024)
# Past the ladders: multiples of this many positions, run eagerly.
PAST_LADDER_STEP = 512
WARM_UP_WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch".split()


def ladder_size(n: int, ladder: tuple[int, ...]) -> int:
    """The smallest size of `ladder` that holds `n`; past it, `n` rounded up to PAST_LADDER_STEP."""
    i = bisect.bisect_left(ladder, n)
    return ladder[i] if i < len(ladder) else math.ceil(n / PAST_LADDER_STEP) * PAST_LADDER_STEP


def batch_size(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    length: int  # prompt positions per row
    audio: int  # audio embeddings per row


@dataclass
class Packed:
    """One bucket's inputs, on the CPU (see `AlignerNet.forward_padded`)."""

    input_ids: torch.Tensor  # [B, T]
    chunks: torch.Tensor  # [B * chunks per row, mel bins, window]
    conv_lens: torch.Tensor  # [B * chunks per row, 3]
    tok_index: torch.Tensor  # [B, A]
    key_mask: torch.Tensor  # [B, A]
    audio_at: torch.Tensor  # [B, T]
    is_audio: torch.Tensor  # [B, T]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.input_ids,
            self.chunks,
            self.conv_lens,
            self.tok_index,
            self.key_mask,
            self.audio_at,
            self.is_audio,
        )


class _Graph:
    """A captured bucket: its static inputs and its output, replayed in place."""

    def __init__(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor, replay):
        self.inputs = inputs
        self.output = output
        self.replay = replay


class BucketedAligner:
    """Aligns batches through `AlignerNet.forward_padded`, a CUDA graph per bucket on a GPU."""

    def __init__(
        self,
        aligner: ForcedAligner,
        *,
        cuda_graphs: bool = True,
        max_graphs: int = 48,
        graph_max_length: int = 1024,
        emulate_graphs: bool = False,
    ):
        self.aligner = aligner
        self.net = aligner.net
        self.config = aligner.config
        self.device = aligner.device
        audio = self.config.audio
        self.window = 2 * audio.n_window
        self.per_chunk = _conv_length(self.window)
        self.mel_bins = audio.num_mel_bins
        self.graphs_on = (cuda_graphs and self.device.type == "cuda") or emulate_graphs
        self.max_graphs = max_graphs
        self.graph_max_length = graph_max_length
        self._graphs: dict[Bucket, _Graph] = {}
        self._pool = None

    # ------------------------------------------------------------------ shapes

    def bucket(self, batch: list[AlignInput]) -> Bucket:
        return Bucket(
            batch_size(len(batch)),
            ladder_size(max(len(x.input_ids) for x in batch), LENGTH_LADDER),
            ladder_size(max(self.audio_tokens(x) for x in batch), AUDIO_LADDER),
        )

    def audio_tokens(self, x: AlignInput) -> int:
        return sum(1 for t in x.input_ids if t == self.config.audio_token_id)

    def groups(self, batch: list[AlignInput]) -> list[list[int]]:
        """Indices of `batch` by prompt length, cut where the length bucket changes."""
        order = sorted(range(len(batch)), key=lambda i: len(batch[i].input_ids))
        out: list[list[int]] = []
        last = None
        for i in order:
            size = ladder_size(len(batch[i].input_ids), LENGTH_LADDER)
            if size != last:
                out.append([])
                last = size
            out[-1].append(i)
        return out

    def pack(self, batch: list[AlignInput], bucket: Bucket) -> Packed:
        """The CPU tensors of `batch` padded to `bucket`."""
        b, t, a = bucket.batch, bucket.length, bucket.audio
        per_row = math.ceil(a / self.per_chunk)
        ids = torch.zeros(b, t, dtype=torch.long)
        chunks = torch.zeros(b * per_row, self.mel_bins, self.window)
        full = [_conv_length_k(self.window, k) for k in (1, 2, 3)]
        conv_lens = torch.tensor(full, dtype=torch.long).repeat(b * per_row, 1)
        tok_index = torch.zeros(b, a, dtype=torch.long)
        key_mask = torch.zeros(b, a, dtype=torch.bool)
        key_mask[:, 0] = True  # a padding row attends somewhere: no softmax over nothing
        audio_at = torch.zeros(b, t, dtype=torch.long)
        is_audio = torch.zeros(b, t, dtype=torch.bool)
        for row, x in enumerate(batch):
            ids[row, : len(x.input_ids)] = torch.tensor(x.input_ids)
            frames = x.mel.shape[1]
            lengths = [self.window] * (frames // self.window) + (
                [frames % self.window] if frames % self.window else []
            )
            tokens = []
            for j, n in enumerate(lengths):
                c = row * per_row + j
                chunks[c, :, :n] = x.mel[:, j * self.window : j * self.window + n]
                if len(lengths) == 1:  # `AudioEncoder.forward` pads no chunk of a one-chunk audio
                    conv_lens[c] = torch.tensor([_conv_length_k(n, k) for k in (1, 2, 3)])
                tokens.extend(c * self.per_chunk + k for k in range(_conv_length(n)))
            if len(tokens) > a:
                raise ValueError(f"{len(tokens)} audio embeddings do not fit a bucket of {a}")
            tok_index[row, : len(tokens)] = torch.tensor(tokens)
            key_mask[row, : len(tokens)] = True
            slots = (ids[row] == self.config.audio_token_id).nonzero().flatten()
            if len(slots) != len(tokens):
                raise ValueError(
                    f"{len(slots)} audio tokens in the prompt but {len(tokens)} audio embeddings"
                )
            audio_at[row, slots] = row * a + torch.arange(len(tokens))
            is_audio[row, slots] = True
        return Packed(ids, chunks, conv_lens, tok_index, key_mask, audio_at, is_audio)

    # ------------------------------------------------------------------ running

    @torch.inference_mode()
    def run(self, batch: list[AlignInput], max_batch: int | None = None) -> list[list[WordTiming]]:
        """The word timings of every input, in order (the same as `ForcedAligner.run`'s)."""
        out: list[list[WordTiming] | None] = [None] * len(batch)
        step = max_batch or len(batch) or 1
        for group in self.groups(batch):
            for start in range(0, len(group), step):
                idx = group[start : start + step]
                part = [batch[i] for i in idx]
                classes = self.classes(part)
                for row, i in enumerate(idx):
                    out[i] = self.aligner.timings(batch[i], classes[row])
        return out  # type: ignore[return-value]

    def classes(self, batch: list[AlignInput]) -> torch.Tensor:
        """The timestamp class of every prompt position of `batch`, [len(batch), T] on the CPU."""
        bucket = self.bucket(batch)
        packed = self.pack(batch, bucket)
        graph = self._graph(bucket, packed)
        if graph is None:
            tensors = [p.to(self.device, non_blocking=True) for p in packed.tensors()]
            return self.net.forward_padded(*tensors)[: len(batch)].cpu()
        for dst, src in zip(graph.inputs, packed.tensors(), strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return graph.output[: len(batch)].cpu()

    def graphable(self, bucket: Bucket) -> bool:
        return (
            self.graphs_on
            and bucket.length <= min(self.graph_max_length, LENGTH_LADDER[-1])
            and bucket.audio <= AUDIO_LADDER[-1]
        )

    def _graph(self, bucket: Bucket, packed: Packed) -> _Graph | None:
        if not self.graphable(bucket):
            return None
        graph = self._graphs.get(bucket)
        if graph is None and len(self._graphs) < self.max_graphs:
            graph = self._graphs[bucket] = self._capture(bucket, packed)
        return graph

    def captured(self) -> list[Bucket]:
        return sorted(self._graphs)

    @torch.inference_mode()
    def warm_up(self, seconds: Sequence[float], max_batch: int, words_per_s: float = 2.5) -> int:
        """Capture, before serving, the graphs of English clips `seconds` long (`words_per_s`
        words a second) at every batch size up to `max_batch`, so the first requests of those
        buckets do not wait for a capture. Returns the graphs captured (0 without graphs)."""
        if not self.graphs_on:
            return 0
        sizes = sorted({batch_size(b) for b in range(1, max_batch + 1)})
        rng = np.random.default_rng(0)
        for s in seconds:
            n_words = max(1, round(s * words_per_s))
            text = " ".join(WARM_UP_WORDS[i % len(WARM_UP_WORDS)] for i in range(n_words))
            pcm = (0.05 * rng.standard_normal(int(s * 24000))).astype(np.float32)
            x = self.aligner.prepare(pcm, 24000, text, "english")
            for b in sizes:
                self.classes([x] * b)
        return len(self._graphs)

    def _capture(self, bucket: Bucket, packed: Packed) -> _Graph:
        """Static copies of a real packing (every index valid), a warm-up, then the capture."""
        inputs = tuple(p.to(self.device).clone() for p in packed.tensors())
        if self.device.type != "cuda":  # emulated: the same static buffers, replayed eagerly
            output = self.net.forward_padded(*inputs)

            def replay() -> None:
                output.copy_(self.net.forward_padded(*inputs))

            return _Graph(inputs, output, replay)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        start = time.monotonic()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # kernel choice and allocator warm-up before the capture
                self.net.forward_padded(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.net.forward_padded(*inputs)
        torch.cuda.synchronize()
        log.info(
            "aligner: captured a CUDA graph for %s in %.2f s (%d graphs)",
            bucket,
            time.monotonic() - start,
            len(self._graphs) + 1,
        )
        return _Graph(inputs, output, graph.replay)


def _conv_length_k(n: int, k: int) -> int:
    """Outputs of the first `k` stride-2 convolutions over `n` frames."""
    for _ in range(k):
        n = (n - 1) // 2 + 1
    return n
