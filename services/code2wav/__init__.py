"""code2wav service: codec frames to 24 kHz PCM with one incremental decoder state per stream."""
