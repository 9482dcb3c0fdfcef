"""The aligner stage: word timestamps of finished segments (Qwen3-ForcedAligner)."""
