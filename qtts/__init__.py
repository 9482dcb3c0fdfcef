"""Shared code of the Qwen3-TTS serving stack, by job:

- `qtts.serving`: what every service process runs on (gRPC server, settings, TLS, internal token,
  logs, tracing, metrics, device failure, the health probe).
- `qtts.streams`: what passes between the stages of a stream (chunk plan, decode events, hash ring,
  voice-prompt keys).
- `qtts.request`: what a request is made of and how it can end (vocabulary, limits, sampling
  overrides, tts.v1 enums, model variants, errors).
- `qtts.model`, `qtts.engine`, `qtts.decode_engine`, `qtts.tiny_model`: the model core, the talker's
  and code2wav's engines, tiny random snapshots.
- `qtts.audio`: reference-clip loading and PCM16 output.
- `qtts.pb` (generated stubs in `qtts/_gen/`), `qtts.protogen` (loaded by setup.py by path) and
  `qtts.resources` (the checkout or the installed package): where the package's files live.
"""
