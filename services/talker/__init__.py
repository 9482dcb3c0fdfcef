"""The talker service (stage 0): batched codec-frame generation, relayed to code2wav and back as audio.

Layout: `config.py` (flags), `server.py` (process wiring, warm-up, drain), `servicer.py` (protobuf
<-> domain), `core.py` (validate, resolve the voice, build the prompt), `stream.py` (one request's
credit-bounded path engine -> code2wav -> caller), `generation_loop.py` + `deadline.py` (the generator
thread and its bookkeeping), `replicas.py` (consistent-hash ring over code2wav replicas with
health checks), `voices.py` + `speaker_cache_client.py` (voice prompts by content key),
`code2wav_client.py` (the Decode call as domain events).
"""
