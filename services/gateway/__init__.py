"""Gateway service: the OpenAI-compatible HTTP API and the public `tts.v1` gRPC API."""
