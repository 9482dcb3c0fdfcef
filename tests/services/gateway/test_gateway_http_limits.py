"""What one HTTP client can hold of the gateway: body size, slow requests, listeners that never
read, and how a stream that fails mid-way ends (real uvicorn, raw sockets, a fake talker)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import httpx
import pytest
import uvicorn
from gateway_fakes import build_gateway, clone_body, free_port

from qtts.request.errors import Unavailable
from services.gateway.http_app import HttpDeps, create_app
from services.gateway.http_limits import Linger, header_timeout_protocol
from services.gateway.server import _UvicornServer

GOOD = clone_body()


@contextlib.asynccontextmanager
async def serve(gw, header_timeout_s: float = 0.0, linger: Linger | None = None, **limits):
    async def stage_health():
        return {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, **limits))
    port = free_port()
    server = _UvicornServer(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            http=header_timeout_protocol(header_timeout_s, linger),
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    gw.url = f"http://127.0.0.1:{port}"
    gw.port = port
    try:
        yield gw
    finally:
        server.should_exit = True
        await task


async def read_all(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


async def test_a_body_over_the_limit_is_a_413_before_it_is_read():
    async with serve(build_gateway(), max_body_bytes=10_000) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        # Announce 200 MB and send none of it: the answer comes at once.
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 200000000\r\n\r\n"
        )
        await writer.drain()
        response = await read_all(reader)
        writer.close()
        assert response.startswith(b"HTTP/1.1 413") and b"payload_too_large" in response
        # Chunked (no content-length): refused once the count passes the limit.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"1000\r\n" + b" " * 4096 + b"\r\n"
        )
        for _ in range(3):
            writer.write(b"1000\r\n" + b" " * 4096 + b"\r\n")
        await writer.drain()
        response = await read_all(reader)
        writer.close()
        assert response.startswith(b"HTTP/1.1 413") and b"connection: close" in response.lower()
        async with httpx.AsyncClient(base_url=gw.url) as c:
            r = await c.post("/v1/audio/speech", json={**GOOD, "stream": False})
            assert r.status_code == 200
    assert len(gw.talker.jobs) == 1


def _read_answer(sock: socket.socket) -> bytes:
    """The whole answer: its head, then as many body bytes as its content-length says (one recv
    may return the head alone on a loaded machine)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        got = sock.recv(65536)
        if not got:
            return answer
        answer += got
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        got = sock.recv(65536)
        if not got:
            break
        body += got
    return head + b"\r\n\r\n" + body


def _send_refused_body(port: int, piece: bytes, every_s: float) -> tuple[bytes, int, float]:
    """Announce 100 MB, read the answer, then send `piece` every `every_s` until the gateway
    closes: the answer, the bytes sent after it and the seconds that took."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000000\r\n\r\n"
        )
        answer = _read_answer(sock)
        sent, started = 0, time.monotonic()
        with contextlib.suppress(OSError):
            while time.monotonic() - started < 20:
                sock.sendall(piece)
                sent += len(piece)
                time.sleep(every_s)
        return answer, sent, time.monotonic() - started


async def test_a_refused_body_is_discarded_up_to_the_linger_bounds():
    linger = Linger(max_bytes=4 << 20, max_s=1.5, idle_s=1.0)
    async with serve(build_gateway(), linger=linger, max_body_bytes=10_000) as gw:
        # The byte bound: a client that sends on at full speed is cut off past it.
        answer, sent, _ = await asyncio.to_thread(_send_refused_body, gw.port, b" " * 65536, 0.0)
        assert answer.startswith(b"HTTP/1.1 413") and b"payload_too_large" in answer
        assert 4 << 20 <= sent < 40 << 20, sent
        # The time bound: one that trickles under the idle bound is cut off at max_s.
        answer, sent, took = await asyncio.to_thread(_send_refused_body, gw.port, b" " * 100, 0.05)
        assert answer.startswith(b"HTTP/1.1 413")
        assert 1.0 < took < 5.0, took
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await c.post("/v1/audio/speech", json={**GOOD, "stream": False})).status_code == 200


async def test_slow_headers_and_stalled_bodies_are_closed():
    async with serve(build_gateway(), header_timeout_s=0.3, max_body_bytes=1 << 20, body_timeout_s=0.3) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\n")  # and never the rest
        await writer.drain()
        start = time.monotonic()
        assert await read_all(reader) == b""  # closed, no response
        assert time.monotonic() - start < 2
        writer.close()
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", gw.port)  # sends nothing
        assert await read_all(idle_reader) == b""
        idle_writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"input": '
        )
        await writer.drain()
        response = await read_all(reader)
        writer.close()
        assert response.startswith(b"HTTP/1.1 408") and b"request_timeout" in response
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await c.post("/v1/audio/speech", json={**GOOD, "stream": False})).status_code == 200


async def test_a_listener_that_never_reads_loses_its_stream_and_slot():
    gw = build_gateway(max_streams=1, frames=100_000, chunk=100, delay_s=0.001)
    async with serve(gw, write_timeout_s=0.5) as gw:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gw.port))
        sock.setblocking(False)
        body = httpx.Request("POST", gw.url + "/v1/audio/speech", json=GOOD).read()
        head = (
            f"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)  # and never reads
        try:
            await asyncio.sleep(0.2)
            assert gw.synth.admission.active == 1
            deadline = time.monotonic() + 10
            while gw.synth.admission.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert gw.synth.admission.active == 0 and gw.talker.active == 0
            async with httpx.AsyncClient(base_url=gw.url) as c:
                r = await c.post("/v1/audio/speech", json={**GOOD, "stream": False, "max_new_tokens": 2})
                assert r.status_code == 200
        finally:
            sock.close()


async def test_a_raw_stream_that_fails_mid_way_is_aborted_not_ended_cleanly(caplog):
    gw = build_gateway(
        frames=6, chunk=1, error_after_first=Unavailable("code2wav at 10.0.0.7:50053 went away")
    )
    async with serve(gw) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        with caplog.at_level(logging.INFO):
            with pytest.raises(httpx.RemoteProtocolError):
                async with c.stream("POST", "/v1/audio/speech", json=GOOD) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_raw():
                        pass
            await asyncio.sleep(0.1)
        assert gw.synth.admission.active == 0
        r = await c.post("/v1/audio/speech", json={**GOOD, "stream_format": "sse"})
        assert r.status_code == 200  # a new connection serves on
    assert not [rec for rec in caplog.records if rec.exc_info], [rec.getMessage() for rec in caplog.records]
    assert any("aborted: UNAVAILABLE" in rec.getMessage() for rec in caplog.records)


async def test_a_trickling_body_meets_the_whole_body_deadline():
    # One byte every 0.1 s never stalls for the 0.3 s body timeout; the 1 s deadline ends it.
    limits = {"max_body_bytes": 1 << 20, "body_timeout_s": 0.3, "body_deadline_s": 1.0}
    async with serve(build_gateway(), **limits) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n"
        )
        start = time.monotonic()

        async def trickle() -> None:
            with contextlib.suppress(OSError):
                while True:
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.1)

        dripping = asyncio.create_task(trickle())
        try:
            response = await read_all(reader)
        finally:
            dripping.cancel()
            writer.close()
        assert response.startswith(b"HTTP/1.1 408") and b"not complete within 1 s" in response
        assert 0.9 < time.monotonic() - start < 3
        async with httpx.AsyncClient(base_url=gw.url) as c:
            assert (await c.post("/v1/audio/speech", json={**GOOD, "stream": False})).status_code == 200
