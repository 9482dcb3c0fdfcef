"""benchmarks/code2wav_host.py: the stand-in decoder, and one short run through the real code2wav
service (a process of its own) driven as the talker drives it."""

from __future__ import annotations

import json

import numpy as np
import torch

from benchmarks.code2wav_host import SAMPLES_PER_FRAME, SleepDecoder, main
from qtts.streams.chunk_plan import STEADY_PLAN
from services.launcher.config import free_port


def test_the_stand_in_decoder_returns_silence_of_each_chunks_length():
    decoder = SleepDecoder(frame_s=0.0, call_s=0.0)
    state = decoder.start(None)
    out = decoder.decode_batch([state, decoder.start(None)], [torch.zeros(3, 16), torch.zeros(5, 16)])
    assert [len(a) for a in out] == [3 * SAMPLES_PER_FRAME, 5 * SAMPLES_PER_FRAME]
    assert all(float(a.abs().max()) == 0.0 for a in out)
    assert len(decoder.decode(state, torch.zeros(2, 16))) == 2 * SAMPLES_PER_FRAME
    decoder.free(state)


def test_a_short_run_through_the_real_service_decodes_every_stream(tmp_path, capsys):
    out = tmp_path / "host.json"
    argv = ["--streams", "3", "6", "--seconds", "1", "--clip-s", "1.2", "--speedup", "20", "--lead-s", "0.4"]
    argv += ["--ramp-s", "0.1", "--port", str(free_port()), "--metrics-port", str(free_port())]
    assert main([*argv, "--out", str(out), "--code2wav-args", "--max-call-frames 8"]) == 0
    result = json.loads(out.read_text())
    assert result["conditions"]["code2wav_args"] == ["--max-call-frames", "8"]
    assert [lv["streams"] for lv in result["levels"]] == [3, 6]
    for level in result["levels"]:
        assert level["failed"] == {} and level["streams_done"] >= level["streams"]
        # 15 frames a clip in chunks of 2, 2, 2, 4, 4 and 1 (the busy plan): one first chunk and
        # five later ones a stream.
        assert STEADY_PLAN.split(15) == [2, 2, 2, 4, 4, 1]
        assert level["chunks"] == 5 * level["streams_done"]
        assert 0 < level["first_chunk_hop_s"]["p50"] <= level["first_chunk_hop_s"]["max"]
        assert level["decode_calls_per_s"] > 0 and level["code2wav_cpu_per_s"] > 0
        assert level["code2wav_means_s"]["open_stream"] is not None
    assert capsys.readouterr().out.count("streams ") == 2
    assert np.isfinite(result["levels"][0]["hop_s"]["p95"])
