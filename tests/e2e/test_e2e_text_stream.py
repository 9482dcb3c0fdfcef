"""Text streamed in through the real stack: the WebSocket (vLLM-Omni's protocol) and gRPC
StreamingSynthesize send an utterance in pieces with pauses, get audio before the text is
complete, the talker serves the utterance as ONE running request (GenerateStream) that waits in
the batch while the text runs dry, and a cancel mid-stream frees the talker slot and the decoder
state."""

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

PAUSE_S = 0.4  # between pieces: the talker consumes a piece's tokens well within it


def _live(stack) -> tuple[float, float]:
    talker = scrape(stack["talker"].spec.metrics_port).get("tts_talker_active_streams", 0.0)
    states = sum(
        scrape(p.spec.metrics_port).get("tts_code2wav_live_states", 0.0)
        for p in stack.processes
        if p.name.startswith("code2wav")
    )
    return talker, states


def _talker_calls(stack) -> tuple[float, float]:
    """Talker RPCs that ended OK: (Generate, GenerateStream)."""
    m = scrape(stack["talker"].spec.metrics_port)

    def count(method: str) -> float:
        return m.get(
            f"tts_rpc_requests_total{{code=OK,method=/talker.v1.TalkerService/{method},service=talker}}", 0.0
        )

    return count("Generate"), count("GenerateStream")


def _waiting_for_text(stack) -> float:
    return scrape(stack["talker"].spec.metrics_port).get("tts_talker_text_waiting_streams", 0.0)


def _event(ws) -> dict:
    msg = ws.recv(timeout=60)
    assert isinstance(msg, str), f"expected a JSON event, got {len(msg)} audio bytes"
    return json.loads(msg)


CONFIG = {
    "type": "session.config",
    "voice": "v",
    "ref_audio": REF_B64,
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream_audio": True,
    "seed": 1,
}


def test_websocket_utterance_in_pieces_is_one_request_then_cancel(stack):
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    before = _talker_calls(stack)
    url = stack.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps(CONFIG))
        ws.send(json.dumps({"type": "input.text", "text": "Hello there, "}))
        start = _event(ws)
        assert (start["type"], start["sentence_index"]) == ("audio.start", 0)
        audio = ws.recv(timeout=60)
        assert isinstance(audio, bytes) and audio  # audio before the rest of the text is sent
        # The talker read the piece's tokens and now waits in the batch for more, not ending.
        assert poll(lambda: _waiting_for_text(stack) == 1, timeout=20), scrape(
            stack["talker"].spec.metrics_port
        )
        for piece in ("this is streamed ", "in pieces, with pauses. ", "And it goes on."):
            time.sleep(PAUSE_S)
            ws.send(json.dumps({"type": "input.text", "text": piece}))
        ws.send(json.dumps({"type": "input.done"}))
        while isinstance(msg := ws.recv(timeout=60), bytes):
            audio += msg
        done = json.loads(msg)
        assert done["type"] == "audio.done" and not done["error"], done
        assert (
            done["sentence_text"] == "Hello there, this is streamed in pieces, with pauses. And it goes on."
        )
        assert len(audio) == done["total_bytes"] == done["num_frames"] * FRAME_BYTES > 0
        end = _event(ws)
        assert (end["type"], end["total_sentences"]) == ("session.done", 1)
        assert end["usage"]["output_tokens"] == done["num_frames"]
        # One running request for the whole utterance.
        assert poll(lambda: _talker_calls(stack) == (before[0], before[1] + 1)), (
            before,
            _talker_calls(stack),
        )

        # An utterance whose text stays open, cancelled once its audio flows. The random model may
        # sample its end among the first frames; a length floor keeps it running until the cancel.
        ws.send(json.dumps({**CONFIG, "min_new_tokens": 200, "max_new_tokens": 400}))
        ws.send(json.dumps({"type": "input.text", "text": "A long story that nobody waits to hear "}))
        assert _event(ws)["type"] == "audio.start"
        assert isinstance(ws.recv(timeout=60), bytes)
        assert poll(lambda: _live(stack) == (1, 1)), _live(stack)
        ws.send(json.dumps({"type": "input.cancel"}))
        while isinstance(msg := ws.recv(timeout=60), bytes):
            pass
        done = json.loads(msg)
        assert (done["type"], done.get("cancelled")) == ("audio.done", True), done
        end = _event(ws)
        assert (end["type"], end.get("cancelled")) == ("session.done", True), end
        assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
        ws.send(json.dumps({"type": "session.close"}))
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)


def test_a_segment_that_reaches_its_length_before_its_text_ends_hands_the_rest_to_a_new_one(stack):
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    url = stack.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({**CONFIG, "max_new_tokens": 4}))
        ws.send(json.dumps({"type": "input.text", "text": "Hello there, this is "}))
        assert _event(ws)["type"] == "audio.start"
        while isinstance(msg := ws.recv(timeout=60), bytes):
            pass
        done = json.loads(msg)
        assert (done["type"], done["finish_reason"], done["num_frames"]) == ("audio.done", "length", 4)
        assert poll(lambda: _live(stack) == (0, 0)), _live(stack)  # the talker let it go, text open or not
        ws.send(json.dumps({"type": "input.text", "text": "the rest of it."}))
        ws.send(json.dumps({"type": "input.done"}))
        start = _event(ws)
        assert (start["type"], start["sentence_index"]) == ("audio.start", 1)
        while isinstance(msg := ws.recv(timeout=60), bytes):
            pass
        assert json.loads(msg)["sentence_text"] == "the rest of it."
        end = _event(ws)
        assert (end["type"], end["total_sentences"], end["usage"]["output_tokens"]) == ("session.done", 2, 8)
        ws.send(json.dumps({"type": "session.close"}))


def _config(**kw) -> tts_pb2.StreamingSynthesizeRequest:
    synthesis = tts_pb2.SynthesizeRequest(reference_audio=REF_WAV, x_vector_only=True, **kw)
    return tts_pb2.StreamingSynthesizeRequest(
        streaming_config=tts_pb2.StreamingSynthesizeConfig(synthesis=synthesis)
    )


def _text(piece: str) -> tts_pb2.StreamingSynthesizeRequest:
    return tts_pb2.StreamingSynthesizeRequest(input=tts_pb2.StreamingSynthesisInput(text=piece))


def test_grpc_streaming_synthesize_in_pieces_is_one_request_then_cancel(stack):
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    before = _talker_calls(stack)
    sent_rest = False

    def requests(request_id: str, texts: list[str], first_audio: threading.Event, floor: int = 0):
        nonlocal sent_rest
        # A length floor keeps an utterance that is to be cancelled from ending by itself first.
        sampling = (
            tts_pb2.SamplingParams(seed=1, min_new_frames=floor) if floor else tts_pb2.SamplingParams(seed=1)
        )
        yield _config(request_id=request_id, sampling=sampling)
        yield _text(texts[0])
        first_audio.wait(60)  # the rest of the text only after audio came back
        sent_rest = True
        for piece in texts[1:]:
            time.sleep(PAUSE_S)
            yield _text(piece)

    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        got_audio = threading.Event()
        starts, summaries, audio, audio_before_rest = [], [], b"", False
        pieces = ["One utterance ", "sent in ", "pieces with pauses."]
        for msg in stub.StreamingSynthesize(requests("grpc-pieces", pieces, got_audio), timeout=120):
            if msg.HasField("segment_start"):
                starts.append(msg.segment_start.text)
            elif msg.HasField("audio"):
                audio += msg.audio.audio
                if not got_audio.is_set():
                    audio_before_rest = not sent_rest
                    got_audio.set()
            elif msg.HasField("segment_summary"):
                summaries.append(msg.segment_summary)
        assert audio_before_rest and len(starts) == 1 and starts[0].startswith("One")
        assert len(summaries) == 1 and len(audio) == summaries[0].num_frames * FRAME_BYTES > 0
        assert poll(lambda: _talker_calls(stack) == (before[0], before[1] + 1)), (
            before,
            _talker_calls(stack),
        )

        hold = threading.Event()
        call = stub.StreamingSynthesize(
            requests("grpc-cancel", ["A long story nobody waits for ", "never sent."], hold, floor=200),
            timeout=120,
        )
        assert next(call).HasField("segment_start") and next(call).HasField("audio")
        assert poll(lambda: _live(stack) == (1, 1)), _live(stack)
        call.cancel()
        hold.set()
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)


def test_a_first_piece_shorter_than_its_first_chunk_is_heard_before_the_rest(stack):
    """A 16-frame first chunk, and a first piece of text that makes fewer frames before the text
    runs dry: the talker sends code2wav what there is, flushed, and code2wav decodes it though the
    chunk is short, so audio comes before the rest of the text is sent (without the flush, none
    came until the next piece)."""
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    sent_rest = threading.Event()
    first_audio = threading.Event()

    def requests():
        streaming = tts_pb2.StreamingOptions(first_chunk_frames=16, chunk_frames_ramp=[16])
        yield _config(request_id="grpc-flush", sampling=tts_pb2.SamplingParams(seed=1), streaming=streaming)
        yield _text("Hello there, ")
        first_audio.wait(60)  # the rest only after audio came back (or a minute without it)
        sent_rest.set()
        yield _text("and the rest of it.")

    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        audio, before_rest, summaries = b"", None, []
        for msg in stub.StreamingSynthesize(requests(), timeout=120):
            if msg.HasField("audio"):
                audio += msg.audio.audio
                if before_rest is None:
                    before_rest = not sent_rest.is_set()
                    assert len(msg.audio.audio) < 16 * FRAME_BYTES  # the cut chunk
                    first_audio.set()
            elif msg.HasField("segment_summary"):
                summaries.append(msg.segment_summary)
        assert before_rest is True
        assert len(summaries) == 1 and len(audio) == summaries[0].num_frames * FRAME_BYTES > 0
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
