"""`python -m tests.e2e.device_fault talker|code2wav FLAGS...`: the real service with a GPU fault
injected into its loop, for the real-process device-failure tests.

A request whose id starts with "poison" makes the engine step (talker) or the decode (code2wav)
raise torch.AcceleratorError, as an illegal memory access does on a GPU; "bad" raises an ordinary
ValueError. In the talker, a text containing MIDWAY fails with a ValueError MIDWAY_S seconds in,
when its audio flows (any front end: the text reaches the talker, a chosen id may not).
Every other request runs on the real (tiny) model.
"""

from __future__ import annotations

import functools
import sys
import time

import torch

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"
MIDWAY_S = 1.0


def _fault_for(request_id: str) -> BaseException | None:
    if request_id.startswith("poison"):
        return torch.AcceleratorError(ILLEGAL_ACCESS)
    if request_id.startswith("bad"):
        return ValueError("a shape this step cannot take")
    return None


def faulty_talker(argv: list[str]) -> int:
    import services.talker.core as core
    import services.talker.server as server
    from services.talker.__main__ import main

    midway: dict[str, float] = {}  # request id -> when it arrived
    real_generate = core.TalkerCore.generate

    async def generate(self, req, *args, **kwargs):
        if "MIDWAY" in req.text and req.request_id:
            midway[req.request_id] = time.monotonic()
        async for item in real_generate(self, req, *args, **kwargs):
            yield item

    core.TalkerCore.generate = generate
    real_factory = server.generator_factory_for

    def factory_for(config):
        make = real_factory(config)

        def build(bundle, max_batch):
            generator = make(bundle, max_batch)
            real_step = generator.step

            @functools.wraps(real_step)  # keeps the signature the engine inspects
            def step(*args, **kwargs):
                for rid in list(generator.active):
                    if (fault := _fault_for(rid)) is not None:
                        raise fault
                    if rid in midway and time.monotonic() - midway[rid] > MIDWAY_S:
                        del midway[rid]
                        raise ValueError("the step failed midway through the stream")
                return real_step(*args, **kwargs)

            generator.step = step
            return generator

        return build

    server.generator_factory_for = factory_for
    return main(argv)


class _FaultyDecoder:
    """The real decoder, except for the states of streams marked faulty."""

    def __init__(self, decoder):
        self._decoder = decoder
        self.faults: dict[int, BaseException] = {}

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def _check(self, state) -> None:
        if (fault := self.faults.get(id(state))) is not None:
            raise fault

    def start(self, prefix_codes=None):
        return self._decoder.start(prefix_codes)

    def decode(self, state, codes):
        self._check(state)
        return self._decoder.decode(state, codes)

    def decode_batch(self, states, codes):
        for state in states:
            self._check(state)
        batch = getattr(self._decoder, "decode_batch", None)
        if batch is None:
            return [self._decoder.decode(s, c) for s, c in zip(states, codes, strict=True)]
        return batch(states, codes)

    def free(self, state):
        self.faults.pop(id(state), None)
        return self._decoder.free(state)


def faulty_code2wav(argv: list[str]) -> int:
    import services.code2wav.core as worker
    import services.code2wav.server as server
    from services.code2wav.__main__ import main

    real_load = server.load_decoder

    def load_decoder(cfg):
        decoder, limits = real_load(cfg)
        return _FaultyDecoder(decoder), limits

    real_open = worker.Code2WavCore.open_stream
    real_state_made = worker.Code2WavCore._state_made
    faulty_streams: dict[int, BaseException] = {}

    async def open_stream(self, request_id, *args, **kwargs):
        stream = await real_open(self, request_id, *args, **kwargs)
        if (fault := _fault_for(request_id)) is not None:
            if stream.decoder_state is not None:
                self.decoder.faults[id(stream.decoder_state)] = fault
            else:  # the state is made after the stream opens: mark it when it is
                faulty_streams[id(stream)] = fault
        return stream

    def state_made(self, stream, began, fut):
        fault = faulty_streams.pop(id(stream), None)
        if fault is not None and not fut.cancelled() and fut.exception() is None:
            self.decoder.faults[id(fut.result())] = fault  # before any decode can see the state
        real_state_made(self, stream, began, fut)

    server.load_decoder = load_decoder
    worker.Code2WavCore.open_stream = open_stream
    worker.Code2WavCore._state_made = state_made
    return main(argv)


if __name__ == "__main__":
    stage, *flags = sys.argv[1:]
    sys.exit({"talker": faulty_talker, "code2wav": faulty_code2wav}[stage](flags))
