"""Hostile traffic against the real processes: a gateway process of its own (the corpus's limits,
short timeouts, a per-client rate) in front of the stack's talker, code2wav and speaker_cache.

- The bad-input corpus (tests/services/gateway/hostile_corpus.py) over HTTP and gRPC: each case its status
  and field, on one keep-alive connection (one channel) that goes on serving; a seeded good
  request repeated while the corpus runs comes back bit-identical to the same request alone.
- Slowloris, a body bomb, listeners that never read, and a flood of 2,000 connections from one
  client: every other client's requests succeed, and the gateway's memory stays bounded.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from e2e_helpers import FRAME, REF_B64, extra_gateway

from qtts.pb import tts_pb2, tts_pb2_grpc
from tests.services.gateway import hostile_corpus as corpus

pytestmark = pytest.mark.e2e

WRITE_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 1.0
FLOOD_HEADER_TIMEOUT_S = 15.0
RATE_PER_S, BURST = 100, 600
# The gateway process's resident memory may grow by at most this much under each attack, and
# never pass the peak bound (it starts at about 110 MB: numpy, PyAV, grpc, FastAPI; the 2,000
# connection flood took it about 40 MB higher). A 200 MB body held in memory would pass both.
RSS_GROWTH_BOUND_MB = 120
RSS_PEAK_BOUND_MB = 400


@dataclasses.dataclass
class Guarded:
    http_url: str
    http_port: int
    grpc_address: str
    pid: int
    log_path: Path

    def rss_mb(self) -> float:
        return psutil.Process(self.pid).memory_info().rss / 2**20


def _guarded_gateway(stack, name: str, header_timeout_s: float):
    cfg = stack.config
    flags = {
        "--max-ref-audio-bytes": corpus.MAX_REF_AUDIO_BYTES,
        "--max-body-bytes": corpus.MAX_BODY_BYTES,
        "--max-ref-audio-seconds": corpus.MAX_REF_AUDIO_SECONDS,
        "--http-header-timeout-s": header_timeout_s,
        "--http-body-timeout-s": 2,
        "--http-write-timeout-s": WRITE_TIMEOUT_S,
        "--max-streams-per-client": 4,
        "--rate-limit-per-s": RATE_PER_S,
        "--rate-limit-burst": BURST,
    }
    with extra_gateway(cfg, name, tuple(str(x) for kv in flags.items() for x in kv)) as gw:
        yield Guarded(gw.url, gw.http_port, gw.grpc_address, gw.proc.popen.pid, gw.proc.log_path)


@pytest.fixture(scope="module")
def guarded(stack) -> Guarded:
    yield from _guarded_gateway(stack, "gateway-guarded", HEADER_TIMEOUT_S)


@pytest.fixture
def flood_guarded(stack) -> Guarded:
    """The guarded gateway with a header timeout the flood's 2,000 connections can meet: with the
    slowloris test's 1 s, a gateway process that the CI machine's other tests kept off its cores
    for a second closed every flood connection unread (twice in four clean-clone runs on
    2026-12-06: 2,000 connected, 2,000 closed, no status), which is the slowloris guard working,
    not what this test is about."""
    yield from _guarded_gateway(stack, "gateway-flood", FLOOD_HEADER_TIMEOUT_S)


GOOD = {
    "input": "A good request, spoken while others misbehave.",
    "ref_audio": REF_B64,
    "x_vector_only_mode": True,
    "seed": 1234,
    "max_new_tokens": 30,
    # Its own chunk plan: the talker's choice follows its recent steps, and code2wav's audio for
    # one stream decoded in other chunks can round differently on the CPU.
    "initial_codec_chunk_frames": 2,
    "response_format": "pcm",
    "stream": False,
}


def good_from(url: str, address: str = "127.0.0.2", timeout: float = 120) -> bytes:
    """The seeded good request from another client (its own source address)."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=timeout) as c:
        r = c.post(url + "/v1/audio/speech", json=GOOD)
    assert r.status_code == 200, r.text
    assert len(r.content) == int(r.headers["x-tts-num-frames"]) * FRAME * 2
    return r.content


class Repeating:
    """The good request, again and again in a thread, until stopped; every answer kept."""

    def __init__(self, url: str):
        self.url, self.stop, self.answers, self.errors = url, threading.Event(), [], []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set() or not (self.answers or self.errors):
            try:
                self.answers.append(good_from(self.url))
            except Exception as exc:  # noqa: BLE001 - reported by join()
                self.errors.append(exc)

    def join(self) -> list[bytes]:
        self.stop.set()
        self.thread.join(180)
        assert not self.errors, self.errors
        return self.answers


def test_corpus_over_http_and_grpc_with_a_bit_identical_neighbour(guarded):
    # The corpus's own checks between cases are cheap calls that never reach the talker: on the
    # CPU a stream batched with another can round differently, and the neighbour must be alone
    # there to be compared bit for bit (no bad request may reach the talker either).
    alone = good_from(guarded.http_url)
    assert good_from(guarded.http_url) == alone  # the seed makes it deterministic
    neighbour = Repeating(guarded.http_url)
    http_failures = asyncio.run(_http_corpus(guarded.http_port))
    grpc_failures = asyncio.run(_grpc_corpus(guarded.grpc_address))
    answers = neighbour.join()
    assert not http_failures, http_failures
    assert not grpc_failures, grpc_failures
    assert answers and all(a == alone for a in answers), [len(a) for a in answers]
    assert httpx.get(guarded.http_url + "/health", timeout=5).json()["status"] == "ok"
    assert asyncio.run(_grpc_synthesis(guarded.grpc_address)) >= 1


# A case answered "at capacity" is asked again: no case expects a capacity refusal, and the
# gateway refuses on the headers, before the body's checks, while the talkers publish no room
# (the shared stack's admission, measured on a busy CI machine, can leave none beside the
# neighbour's stream: a clean-clone run of 2026-12-06 got one such 429 for a case wanting a 400).
CAPACITY_RETRIES = 40
CAPACITY_RETRY_S = 0.25


async def _http_corpus(port: int) -> list:
    conn, failures = await corpus.Http11.open(port), []
    try:
        for case in corpus.HTTP_CASES:
            for _ in range(CAPACITY_RETRIES):
                status, headers, body = await conn.request(
                    case.method, case.path, case.body, case.content_type
                )
                if status != 429 or b"at capacity" not in body or not conn.usable:
                    break
                await asyncio.sleep(CAPACITY_RETRY_S)
            error = json.loads(body).get("error", {}) if body.startswith(b"{") else {}
            if (status, error.get("param")) != (case.status, case.param) or not error.get("message"):
                failures.append((case.id, status, body[:200]))
            if case.closes:
                conn.close()
                conn = await corpus.Http11.open(port)
                continue
            # The same connection serves on (a cheap request: the talker is busy with the neighbour).
            assert conn.usable and headers.get("connection") != "close", case.id
            status, _, body = await conn.request("GET", "/v1/models")
            assert status == 200 and json.loads(body)["data"], case.id
    finally:
        conn.close()
    return failures


async def _grpc_corpus(address: str) -> list:
    failures = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        for case in corpus.GRPC_CASES:
            for _ in range(CAPACITY_RETRIES):
                exc = await corpus.call(channel, case.method, case.payloads)
                if exc is None or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    break
                if "at capacity" not in (exc.details() or ""):
                    break
                await asyncio.sleep(CAPACITY_RETRY_S)
            got = (exc.code(), exc.details()) if exc is not None else (grpc.StatusCode.OK, "")
            if got[0] != case.code or (case.param is not None and case.param not in got[1]):
                failures.append((case.id, got[0], got[1][:200]))
            elif corpus.bad_request_field(exc) != case.field:
                failures.append((case.id, "BadRequest field", corpus.bad_request_field(exc), case.field))
            await stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=30)  # the channel serves on
    return failures


async def _grpc_synthesis(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        msgs = [m async for m in stub.Synthesize(corpus.synthesize(max_new_frames=4), timeout=120)]
    return msgs[-1].summary.num_frames


class RssWatch:
    """The gateway process's peak resident memory while the block runs (sampled every 20 ms)."""

    def __init__(self, guarded: Guarded):
        self.guarded, self.start_mb, self.peak_mb = guarded, guarded.rss_mb(), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.guarded.rss_mb())
            time.sleep(0.02)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self.guarded.rss_mb())

    def assert_bounded(self) -> None:
        growth = self.peak_mb - self.start_mb
        assert growth < RSS_GROWTH_BOUND_MB and self.peak_mb < RSS_PEAK_BOUND_MB, (
            self.start_mb,
            self.peak_mb,
        )


def test_slowloris_connections_are_closed_by_the_header_timeout(guarded):
    conns = []
    with RssWatch(guarded) as rss:
        for _ in range(400):
            s = socket.create_connection(("127.0.0.1", guarded.http_port))
            s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n")
            conns.append(s)
        opened = time.monotonic()
        assert good_from(guarded.http_url)  # another client is served meanwhile
        for s in conns:  # one more header line now and then keeps none of them alive
            with contextlib.suppress(OSError):
                s.sendall(b"x-slow: 1\r\n")
        closed = 0
        for s in conns:
            s.settimeout(max(0.1, opened + HEADER_TIMEOUT_S + 10 - time.monotonic()))
            try:
                data = s.recv(1)
            except TimeoutError:
                data = None  # still open: the header timeout did not hold
            except ConnectionResetError:
                data = b""
            closed += data == b""  # closed without a response
            s.close()
    assert closed == len(conns)
    rss.assert_bounded()


def test_a_body_bomb_is_refused_before_it_is_read_and_memory_stays_bounded(guarded):
    with RssWatch(guarded) as rss:
        # Announced: a 413 at once, without sending any of it.
        s = socket.create_connection(("127.0.0.1", guarded.http_port))
        s.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 200000000\r\n\r\n"
        )
        s.settimeout(10)
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
        s.close()

        # Unannounced (chunked), three at once, sent as fast as the gateway takes it: each is cut
        # off at the limit; the gateway never holds more than the limit of any of them.
        def bomb() -> bytes:
            s = socket.create_connection(("127.0.0.1", guarded.http_port))
            s.sendall(
                b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            chunk = b"100000\r\n" + b" " * 0x100000 + b"\r\n"
            try:
                for _ in range(200):  # 200 MB
                    s.sendall(chunk)
            except OSError:
                pass  # the gateway closed the connection: the rest is never read
            s.settimeout(10)
            try:
                return s.recv(4096)
            except OSError:
                return b""
            finally:
                s.close()

        results = []
        threads = [threading.Thread(target=lambda: results.append(bomb())) for _ in range(3)]
        for t in threads:
            t.start()
        assert good_from(guarded.http_url)
        for t in threads:
            t.join(60)
    # A 413 when the client was still there to read it (a reset may come first), or, while the
    # shared stack's talkers publish no room (CAPACITY_RETRIES), the gateway's 429 on the headers:
    # refused before the body is read, too.
    assert all(
        r.startswith(b"HTTP/1.1 413") or r == b"" or (r.startswith(b"HTTP/1.1 429") and b"at capacity" in r)
        for r in results
    ), results
    rss.assert_bounded()


def test_listeners_that_never_read_lose_their_own_stream_and_slot(guarded):
    # Streams that never read: slow audio (speed 0.25 at 48 kHz, 30 KB a frame) fills the socket
    # buffers, a write then waits, and after WRITE_TIMEOUT_S the stream is ended and its slot freed.
    body = json.dumps(
        {**GOOD, "max_new_tokens": 2000, "speed": 0.25, "sample_rate": 48000, "stream": True, "seed": 5}
    ).encode()
    head = (
        f"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    watcher = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=10)

    def active() -> int:
        return watcher.get(guarded.http_url + "/v1/status").json()["gateway"]["active_streams"]

    socks = []
    try:
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", guarded.http_port))
            s.sendall(head + body)
            socks.append(s)
        deadline = time.monotonic() + 60
        while active() < len(socks):
            assert time.monotonic() < deadline, "the listeners' streams never started"
            time.sleep(0.1)
        assert good_from(guarded.http_url)  # another client is served while they stall
        while active() > 0:
            assert time.monotonic() < deadline + 60, "stalled streams kept their slots"
            time.sleep(0.25)
        # Cut by the write timeout, not ended: 2,000 frames take far longer than this.
        cut = guarded.log_path.read_text(errors="replace").count("the client took no audio")
        assert cut >= len(socks), cut
        # The same client's slots are its own again: no per-client refusal. A talker's room comes
        # back with its next published room, up to a watch interval after the gateway ended the
        # streams, and the shared stack's admission on a busy CI machine can publish none for a
        # while: "at capacity" is asked again, as the corpus does (CAPACITY_RETRIES).
        for _ in range(CAPACITY_RETRIES):
            r = httpx.post(
                guarded.http_url + "/v1/audio/speech", json={**GOOD, "max_new_tokens": 2}, timeout=60
            )
            if r.status_code != 429 or "at capacity" not in r.text:
                break
            time.sleep(CAPACITY_RETRY_S)
        assert r.status_code == 200, r.text
    finally:
        watcher.close()
        for s in socks:
            s.close()


def test_a_flood_of_2000_connections_from_one_client_leaves_others_served(flood_guarded):
    guarded = flood_guarded
    small = {**GOOD, "max_new_tokens": 2, "ref_audio": base64.b64encode(corpus.wav(0.3)).decode()}
    small_body = json.dumps(small).encode()
    with RssWatch(guarded) as rss:
        neighbour = Repeating(guarded.http_url)
        outcome = asyncio.run(_flood(guarded.http_port, 2000, small_body))
        answers = neighbour.join()
    # The flood's own requests: served within its per-client limits, the rest refused with 429.
    summary = {**outcome, "statuses": collections.Counter(outcome["statuses"])}
    assert outcome["statuses"] and set(outcome["statuses"]) <= {200, 429}, summary
    assert outcome["connected"] >= 1900, summary
    assert answers and len({len(a) for a in answers}) == 1  # every neighbour request whole
    rss.assert_bounded()
    # After the flood the flooding client is served again, as soon as its bucket has a token and
    # its streams have ended.
    deadline = time.monotonic() + 30
    while (r := httpx.post(guarded.http_url + "/v1/audio/speech", json=small, timeout=60)).status_code == 429:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.status_code == 200 and len(r.content) == int(r.headers["x-tts-num-frames"]) * FRAME * 2


async def _flood(port: int, connections: int, body: bytes) -> dict:
    head = (
        f"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    statuses: list[int] = []
    connected = 0
    # Why connections ended without an answer (an exception's type, or "closed"): a failure of
    # the test says whether the connects, the writes or the answers failed.
    ended: collections.Counter[str] = collections.Counter()

    async def one() -> None:
        nonlocal connected
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            ended[f"connect: {type(exc).__name__} {exc.errno}"] += 1
            return
        connected += 1
        try:
            for _ in range(2):  # keep-alive: two requests each
                writer.write(head + body)
                await writer.drain()
                line = await asyncio.wait_for(reader.readline(), 60)
                if not line:
                    ended["closed"] += 1
                    return
                statuses.append(int(line.split()[1]))
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode("latin-1").partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            ended[type(exc).__name__] += 1
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    return {"statuses": statuses, "connected": connected, "ended": dict(ended)}


def _openai_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    return error


def test_a_client_that_sends_its_whole_too_large_body_reads_the_413(guarded):
    # http.client, requests and httpx send no `Expect: 100-continue`: they write the whole body
    # before reading. The gateway answers 413 after the headers; closing then, with the body
    # unread, reset the connection, and the client saw ECONNRESET instead of the answer. It
    # lingers instead, reading and discarding the rest, as nginx does.
    host, port = guarded.http_url.removeprefix("http://").split(":")
    # 64 MB announced by its content-length, then 64 MB chunked (refused once past the limit).
    for body in (b" " * (64 << 20), (b" " * (1 << 20) for _ in range(64))):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request(
                "POST",
                "/v1/audio/speech",
                body=body,
                headers={"content-type": "application/json"},
                encode_chunked=not isinstance(body, bytes),
            )
            resp = conn.getresponse()
            status, answer = resp.status, resp.read()
        finally:
            conn.close()
        assert status == 413, answer[:300]
        assert _openai_error(answer)["code"] == "payload_too_large"
    # A 50 MB voice upload, multipart through httpx.
    with httpx.Client(timeout=60) as client:
        r = client.post(
            guarded.http_url + "/v1/audio/voices",
            data={"name": "big", "consent": "c"},
            files={"audio_sample": ("big.wav", b"RIFF" + bytes(50 << 20), "audio/wav")},
        )
    assert r.status_code == 413, r.text[:300]
    assert _openai_error(r.content)["code"] == "payload_too_large"
    assert good_from(guarded.http_url)  # and the gateway serves on
