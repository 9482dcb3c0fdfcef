"""Qwen3-ForcedAligner: word timestamps for a stretch of audio and its transcript.

`load_aligner` loads a snapshot (or dummy weights), `ForcedAligner.align` aligns one input,
`ForcedAligner.prepare` + `ForcedAligner.run` a batch. `words.split_words` is the official word
splitting per language.
"""

from qtts.model.aligner.aligner import AlignInput, ForcedAligner, WordTiming, load_aligner, resample_to_16k
from qtts.model.aligner.config import SHIPPED_CONFIG, AlignerConfig, open_aligner_snapshot
from qtts.model.aligner.words import UnsupportedLanguage, split_words

__all__ = [
    "SHIPPED_CONFIG",
    "AlignInput",
    "AlignerConfig",
    "ForcedAligner",
    "UnsupportedLanguage",
    "WordTiming",
    "load_aligner",
    "open_aligner_snapshot",
    "resample_to_16k",
    "split_words",
]
