"""Text streamed in through the real stack: the WebSocket (vLLM-Omni's protocol) and gRPC
StreamingSynthesize get audio for the first sentence before the text is complete, and a cancel
mid-stream frees the talker slot and the decoder state."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from e2e_helpers import FRAME_BYTES, REF_B64, REF_WAV, poll, scrape
from websockets.sync.client import connect

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

LONG = 3000  # frames: far more than the tests wait for before they cancel


def _live(stack) -> tuple[float, float]:
    talker = scrape(stack["talker"].spec.metrics_port).get("tts_talker_active_streams", 0.0)
    states = sum(
        scrape(p.spec.metrics_port).get("tts_code2wav_live_states", 0.0)
        for p in stack.processes
        if p.name.startswith("code2wav")
    )
    return talker, states


def _event(ws) -> dict:
    msg = ws.recv(timeout=60)
    assert isinstance(msg, str), f"expected a JSON event, got {len(msg)} audio bytes"
    return json.loads(msg)


def test_websocket_text_in_pieces_then_cancel(stack):
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    config = {
        "type": "session.config",
        "voice": "v",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "response_format": "pcm",
        "stream_audio": True,
        "max_new_tokens": 12,
        "seed": 1,
    }
    url = stack.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps(config))
        ws.send(json.dumps({"type": "input.text", "text": "Hello there, "}))
        time.sleep(0.2)
        ws.send(json.dumps({"type": "input.text", "text": "this is streamed. And"}))
        start = _event(ws)
        assert (start["type"], start["sentence_text"]) == ("audio.start", "Hello there, this is streamed.")
        audio = b""
        while isinstance(msg := ws.recv(timeout=60), bytes):  # before the rest of the text is sent
            audio += msg
        done = json.loads(msg)
        assert done["type"] == "audio.done" and not done["error"], done
        assert len(audio) == done["total_bytes"] == 12 * FRAME_BYTES and done["finish_reason"] == "length"
        ws.send(json.dumps({"type": "input.text", "text": " more"}))
        ws.send(json.dumps({"type": "input.done"}))
        assert _event(ws)["sentence_text"] == "And more"
        while isinstance(msg := ws.recv(timeout=60), bytes):
            pass
        end = _event(ws)
        assert (end["type"], end["total_sentences"], end["usage"]["output_tokens"]) == ("session.done", 2, 24)
        # A long utterance, cancelled once its audio flows.
        ws.send(json.dumps({"type": "session.config", **config, "max_new_tokens": LONG}))
        ws.send(json.dumps({"type": "input.text", "text": "A long story that nobody waits to hear. "}))
        assert _event(ws)["type"] == "audio.start"
        assert isinstance(ws.recv(timeout=60), bytes)
        assert poll(lambda: _live(stack) == (1, 1)), _live(stack)
        ws.send(json.dumps({"type": "input.cancel"}))
        while isinstance(msg := ws.recv(timeout=60), bytes):
            pass
        assert json.loads(msg)["cancelled"] is True
        assert _event(ws)["cancelled"] is True
        assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
        ws.send(json.dumps({"type": "session.close"}))
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)


def _config(**kw) -> tts_pb2.StreamingSynthesizeRequest:
    synthesis = tts_pb2.SynthesizeRequest(reference_audio=REF_WAV, x_vector_only=True, **kw)
    return tts_pb2.StreamingSynthesizeRequest(
        streaming_config=tts_pb2.StreamingSynthesizeConfig(synthesis=synthesis)
    )


def _text(piece: str) -> tts_pb2.StreamingSynthesizeRequest:
    return tts_pb2.StreamingSynthesizeRequest(input=tts_pb2.StreamingSynthesisInput(text=piece))


def test_grpc_streaming_synthesize_pieces_then_cancel(stack):
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    sent_rest = False

    def requests(frames: int, texts: list[str], first_audio):
        nonlocal sent_rest
        yield _config(max_new_frames=frames, request_id=f"grpc-stream-{frames}")
        yield _text(texts[0])
        first_audio.wait(60)  # the rest of the text only after audio came back
        sent_rest = True
        for piece in texts[1:]:
            yield _text(piece)

    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        got_audio = threading.Event()
        segments, audio_before_rest = [], False
        for msg in stub.StreamingSynthesize(
            requests(12, ["One sentence first. Then", " the rest."], got_audio), timeout=120
        ):
            if msg.HasField("segment_start"):
                segments.append(msg.segment_start.text)
            elif msg.HasField("audio") and not got_audio.is_set():
                audio_before_rest = not sent_rest
                got_audio.set()
            elif msg.HasField("segment_summary"):
                assert msg.segment_summary.num_frames == 12
        assert audio_before_rest and segments == ["One sentence first.", "Then the rest."]

        hold = threading.Event()
        call = stub.StreamingSynthesize(
            requests(LONG, ["A long story nobody waits for. ", "Never sent."], hold), timeout=120
        )
        assert next(call).HasField("segment_start") and next(call).HasField("audio")
        assert poll(lambda: _live(stack) == (1, 1)), _live(stack)
        call.cancel()
        hold.set()
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
