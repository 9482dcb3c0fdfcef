"""The talker with its engine in a process of its own (`--engine-process on`), on the tiny real
models on the CPU: the same codes as in one process, one metrics view of both processes, cancel,
refusal, appended text, and the end of the engine process failing its streams."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from qtts.pb import talker_pb2, tts_pb2
from qtts.streams.chunk_plan import ChunkPlan
from services.talker.metrics_merge import MergedRegistry, merge_families
from tests.services.talker.fakes import FakeCode2Wav
from tests.services.talker.stack import eventually, generate_all, talker_stack

GREEDY = tts_pb2.SamplingParams(greedy=True, seed=5)
TEXT = "Hello there, this is a streamed text that keeps going for a while. Then it ends."


def process_stack(snapshot, replicas, **kw):
    return talker_stack(replicas, bundle=None, model=str(snapshot), engine_process="on", **kw)


def reference_pcm() -> bytes:
    t = np.arange(24000 * 2) / 24000
    return (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t)).astype("<f4").tobytes()


async def frames_of(stack, c2w, **fields) -> tuple[list[int], int, object]:
    _, summary = await generate_all(stack.stub, **fields)
    log = c2w.logs[-1]
    return log.frames, log.prefix_frames, summary


@pytest.mark.parametrize("model_type", ["custom_voice", "base"])
async def test_the_engine_process_makes_the_codes_of_one_process(
    model_type, tiny_snapshot, tiny_talker_bundle
):
    bundle = tiny_talker_bundle(model_type)
    if model_type == "base":  # ICL voice clone: reference frames go to code2wav as well
        fields = dict(reference_pcm_f32=reference_pcm(), reference_text="A short reference clip.")
    else:
        fields = dict(voice=sorted(bundle.info.speakers)[0])
    fields.update(text="Hello world, one more time.", language="english", max_new_frames=12, sampling=GREEDY)
    here = FakeCode2Wav("c2w-a")
    async with talker_stack([here], bundle=bundle) as s:
        want = await frames_of(s, here, request_id="here", **fields)
    there = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot(model_type), [there]) as s:
        assert s.talker.engine_client is not None and s.talker.engine_client.alive
        got = await frames_of(s, there, request_id="there", **fields)
        assert s.talker.engine_client.facts.pid != os.getpid()
    assert got[0] == want[0] and len(got[0]) == 12
    assert got[1] == want[1] and (got[1] > 0) == (model_type == "base")
    assert (got[2].num_frames, got[2].num_input_tokens) == (want[2].num_frames, want[2].num_input_tokens)
    assert got[2].num_samples == 12 * 1920


async def test_one_scrape_shows_both_processes_metrics(tiny_snapshot):
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w]) as s:
        _, summary = await generate_all(
            s.stub,
            request_id="m",
            text="Hello world.",
            voice="vivian",
            language="english",
            max_new_frames=4,
            sampling=GREEDY,
        )
        registry = s.talker.metrics.registry
        assert isinstance(registry, MergedRegistry)
        # Counted in the engine process: frames and steps.
        assert registry.get_sample_value("tts_talker_frames_total") == summary.num_frames == 4
        assert registry.get_sample_value("tts_talker_batch_size_count") >= 4
        # Counted in the front: the call and the prompt's build.
        labels = {"service": "talker", "method": "/talker.v1.TalkerService/Generate", "code": "OK"}
        assert registry.get_sample_value("tts_rpc_requests_total", labels) == 1
        stage = {"service": "talker", "stage": "build_prompt"}
        assert registry.get_sample_value("tts_stage_latency_seconds_count", stage) == 1
        await eventually(lambda: s.gauge("tts_talker_active_streams") == 0)
        names = [f.name for f in registry.collect()]
        assert len(names) == len(set(names))  # each family once
        # The start-up, phase by phase: the engine process's own phases reach the front's page.
        startup = {
            phase: registry.get_sample_value("tts_startup_seconds", {"service": "talker", "phase": phase})
            for phase in (
                "start the engine process",
                "engine: load the model",
                "engine: build the engine (graph capture)",
                "serving",
            )
        }
        assert all(v is not None and v >= 0 for v in startup.values()), startup
        assert startup["start the engine process"] >= startup["engine: load the model"]
        assert startup["serving"] >= startup["start the engine process"]


async def test_cancel_frees_the_stream_in_the_engine_process(tiny_snapshot):
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w]) as s:
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(
                request_id="bye",
                text="Hello world, this is long.",
                voice="vivian",
                max_new_frames=500,
                sampling=GREEDY,
            )
        )
        assert (await call.read()).WhichOneof("event") == "audio"
        assert s.gauge("tts_talker_active_streams") == 1
        call.cancel()
        await eventually(lambda: c2w.live == 0 and s.gauge("tts_talker_active_streams") == 0, timeout=30)
        # The engine still serves.
        _, summary = await generate_all(
            s.stub, request_id="next", text="Hi.", voice="vivian", max_new_frames=3, sampling=GREEDY
        )
        assert summary.num_frames == 3


async def test_a_refusal_in_the_engine_process_reaches_the_caller(tiny_snapshot):
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w], max_batch=1, max_queue=0) as s:
        first = s.stub.Generate(
            talker_pb2.GenerateRequest(
                request_id="a", text="Hello world.", voice="vivian", max_new_frames=400
            )
        )
        assert (await first.read()).WhichOneof("event") == "audio"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, request_id="b", text="Hello again.", voice="vivian", max_new_frames=3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert s.talker.metrics.registry.get_sample_value("tts_talker_refused_total") == 1
        first.cancel()


@pytest.mark.parametrize("fresh", [True, False])
async def test_the_front_refuses_at_once_by_the_engine_s_last_room(tiny_snapshot, monkeypatch, fresh):
    """With the room worked out for a gateway spent, the front refuses the next request itself: no
    build reaches the engine process (its own refusals stay 0). A stale room (`fresh` False) is
    not used: the engine process refuses, as before."""
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w], max_batch=1, max_queue=0) as s:
        if not fresh:
            monkeypatch.setattr(s.talker.core.front_room, "_fresh_s", -1.0)
        first = s.stub.Generate(
            talker_pb2.GenerateRequest(
                request_id="a", text="Hello world.", voice="vivian", max_new_frames=400
            )
        )
        assert (await first.read()).WhichOneof("event") == "audio"
        room = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest(caller="gw"))
        assert (room.accept, room.running) == (0, 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, request_id="b", text="Hello again.", voice="vivian", max_new_frames=3)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        registry = s.talker.metrics.registry
        assert registry.get_sample_value("tts_talker_refused_total") == 1
        if fresh:
            assert "no room for another request (1 streams generating, 0 waiting" in err.value.details()
            assert registry.get_sample_value("tts_talker_room_refused_total") == 1
        else:
            assert registry.get_sample_value("tts_talker_room_refused_total") == 0
        first.cancel()


async def test_text_in_pieces_through_the_engine_process(tiny_snapshot, tiny_talker_bundle):
    bundle = tiny_talker_bundle("custom_voice")
    speaker = sorted(bundle.info.speakers)[0]
    common = dict(voice=speaker, language="english", sampling=GREEDY)
    here = FakeCode2Wav("c2w-a")
    async with talker_stack([here], bundle=bundle) as s:
        want, _, _ = await frames_of(s, here, text=TEXT, streaming_text=True, **common)
    words = TEXT.split(" ")
    pieces = [words[0]] + [" " + w for w in words[1:]]

    async def requests():
        yield talker_pb2.GenerateStreamRequest(start=talker_pb2.GenerateRequest(text=pieces[0], **common))
        for i, piece in enumerate(pieces[1:]):
            await asyncio.sleep(0.01)
            yield talker_pb2.GenerateStreamRequest(
                append=talker_pb2.TextAppend(text=piece, final=i == len(pieces) - 2)
            )

    there = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [there]) as s:
        summary = None
        async for msg in s.stub.GenerateStream(requests()):
            if msg.WhichOneof("event") == "summary":
                summary = msg.summary
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert summary.num_input_tokens > len(words)
        assert there.logs[0].frames == want
        await eventually(lambda: s.gauge("tts_talker_active_streams") == 0)


async def test_a_flush_for_text_crosses_the_engine_process(tiny_snapshot, tiny_talker_bundle):
    """The engine process tells the front that a stream waits for text (Frame.text_waiting): the
    frames short of a 16-frame first chunk go to code2wav flushed, and audio comes before more
    text is sent."""
    bundle = tiny_talker_bundle("custom_voice")
    common = dict(voice=sorted(bundle.info.speakers)[0], language="english", sampling=GREEDY)
    c2w = FakeCode2Wav("c2w-a", window=64, plan=(16, (16,)))
    async with process_stack(tiny_snapshot("custom_voice"), [c2w]) as s:
        more = asyncio.Event()

        async def requests():
            yield talker_pb2.GenerateStreamRequest(
                start=talker_pb2.GenerateRequest(text="Hello there, ", **common)
            )
            await more.wait()
            rest = TEXT[len("Hello there, ") :]
            yield talker_pb2.GenerateStreamRequest(append=talker_pb2.TextAppend(text=rest, final=True))

        call = s.stub.GenerateStream(requests())
        first = await asyncio.wait_for(call.read(), 60)  # without the flush: nothing until `more`
        assert first.WhichOneof("event") == "audio" and 0 < first.audio.num_frames < 16
        assert c2w.logs[0].flushes == [first.audio.num_frames]
        more.set()
        while (msg := await call.read()) != grpc.aio.EOF:
            summary = msg.summary if msg.WhichOneof("event") == "summary" else None
        assert summary is not None and summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert c2w.logs[0].violations == [] and c2w.logs[0].ended
        await eventually(lambda: s.gauge("tts_talker_active_streams") == 0)


async def test_signals_to_the_process_group_leave_the_engine_to_the_front(tiny_snapshot):
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w]) as s:
        engine = s.talker.engine_client
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(
                request_id="on",
                text="Hello world.",
                voice="vivian",
                max_new_frames=40,
                sampling=GREEDY,  # sampled codes may end the clip early; greedy ones run to 40
            )
        )
        assert (await call.read()).WhichOneof("event") == "audio"
        # A Ctrl-C or a SIGTERM to the group reaches the engine process: the stream goes on.
        os.kill(engine.facts.pid, signal.SIGINT)
        os.kill(engine.facts.pid, signal.SIGTERM)
        while (msg := await call.read()) != grpc.aio.EOF:
            last = msg
        assert last.WhichOneof("event") == "summary" and last.summary.num_frames == 40
        assert last.summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert engine.alive
    # The front's stop ended it.
    assert not engine.alive


async def test_the_end_of_the_engine_process_fails_its_streams_and_the_talker(tiny_snapshot):
    exits: list[int] = []
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w], exit_process=exits.append) as s:
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(
                request_id="x", text="Hello world.", voice="vivian", max_new_frames=500
            )
        )
        assert (await call.read()).WhichOneof("event") == "audio"
        os.kill(s.talker.engine_client.facts.pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() != grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine process ended" in err.value.details()
        await eventually(lambda: exits == [3], timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, request_id="y", text="Hi.", voice="vivian", max_new_frames=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_merged_samples_are_summed_and_each_family_stays_one():
    front, engine = CollectorRegistry(), CollectorRegistry()
    for registry, value in ((front, 2), (engine, 5)):
        c = Counter("tts_x_total", "x", ["stage"], registry=registry)
        c.labels("shared").inc(value)
        c.labels("only_here" if registry is front else "only_there").inc(1)
        Gauge("tts_g", "g", registry=registry).set(0 if registry is front else 7)
    merged = {f.name: f for f in merge_families(front.collect(), engine.collect())}
    samples = {(s.name, tuple(s.labels.items())): s.value for s in merged["tts_x"].samples}
    assert samples[("tts_x_total", (("stage", "shared"),))] == 7
    assert samples[("tts_x_total", (("stage", "only_here"),))] == 1
    assert samples[("tts_x_total", (("stage", "only_there"),))] == 1
    created = [
        s.value
        for s in merged["tts_x"].samples
        if s.name == "tts_x_created" and s.labels["stage"] == "shared"
    ]
    assert len(created) == 1
    assert MergedRegistry(front, lambda: list(engine.collect())).get_sample_value("tts_g") == 7


async def test_the_engine_process_prompt_queue_keeps_the_first_audio_budget(tiny_snapshot):
    # A budget shorter than any wait: every prompt has waited past it when its build would start.
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w], first_audio_budget_ms=0.001) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, request_id="late", text="Hello.", voice="vivian", max_new_frames=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waited" in err.value.details() and "first-audio budget" in err.value.details()
        assert c2w.live == 0


async def test_prompts_nobody_claims_are_freed_in_the_engine_process(tiny_snapshot):
    from qtts.model import SynthesisSpec
    from services.talker.engine_wire import spec_to_wire

    nothing = {"prompts": 0, "open_texts": 0, "requests": 0}
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w]) as s:
        engine = s.talker.engine_client

        async def held_becomes(want, timeout: float = 20.0) -> None:
            deadline = asyncio.get_running_loop().time() + timeout
            while (got := await asyncio.to_thread(engine.call, "held", timeout=10)) != want:
                assert asyncio.get_running_loop().time() < deadline, got
                await asyncio.sleep(0.05)

        await generate_all(s.stub, request_id="done", text="Hello.", voice="vivian", max_new_frames=2)
        await held_becomes(nothing)
        # A build whose caller went away: freed on arrival (or at once if it had just arrived).
        spec = SynthesisSpec(text="Hello there.", task="custom_voice", speaker="vivian", language="english")
        engine.abandon(engine.call_async("build_prompt", spec_to_wire(spec), 0.0, 0.0))
        await held_becomes(nothing)

        # Appended text whose request ends before its prompt could be built.
        async def requests():
            yield talker_pb2.GenerateStreamRequest(
                start=talker_pb2.GenerateRequest(request_id="gone", text="Hello", voice="vivian")
            )
            await asyncio.Event().wait()

        call = s.stub.GenerateStream(requests())
        await held_becomes({**nothing, "open_texts": 1})
        call.cancel()
        await held_becomes(nothing)


@pytest.mark.parametrize("prompt_builds", ["batched", "pipelined"])
async def test_prompts_queued_together_are_each_answered(prompt_builds, tiny_snapshot, tiny_talker_bundle):
    # Builds queued while the prompt thread is busy are built as one batch and waited for once
    # (batched), or each answered once built (pipelined): each caller still gets its own prompt,
    # and one refused in the middle fails alone.
    from qtts.model import SynthesisSpec
    from qtts.request.errors import InvalidArgument, ResourceExhausted
    from services.talker.engine_wire import spec_to_wire

    builder = tiny_talker_bundle("custom_voice").prompt_builder
    texts = [f"Hello number {i}, {'and more words ' * i}here." for i in range(8)]
    specs = [SynthesisSpec(text=t, task="custom_voice", speaker="vivian", language="english") for t in texts]
    specs[5] = dataclasses.replace(specs[5], speaker="nobody")  # fails alone inside a batch
    c2w = FakeCode2Wav("c2w-a")
    async with process_stack(tiny_snapshot("custom_voice"), [c2w], prompt_builds=prompt_builds) as s:
        engine = s.talker.engine_client
        now = time.perf_counter()
        futures = [
            engine.call_async("build_prompt", spec_to_wire(spec), now - 10.0 if i == 3 else now, 5.0)
            for i, spec in enumerate(specs)
        ]
        results = [await asyncio.wrap_future(f) if i not in (3, 5) else None for i, f in enumerate(futures)]
        with pytest.raises(ResourceExhausted, match="first-audio budget"):
            await asyncio.wrap_future(futures[3])
        with pytest.raises(InvalidArgument, match="unknown speaker 'nobody'"):
            await asyncio.wrap_future(futures[5])
        for i, (spec, remote) in enumerate(zip(specs, results, strict=True)):
            if i in (3, 5):
                continue
            assert remote.num_text_tokens == builder.build(spec).num_text_tokens
            assert remote.build_s > 0
        assert len({r.key for r in results if r is not None}) == 6
        for r in results:
            if r is not None:
                engine.release_prompt(r)


async def test_grants_and_clocks_of_one_loop_turn_cross_the_pipe_together():
    from types import SimpleNamespace

    from services.talker.deadline import StreamCredit
    from services.talker.engine_client import EngineClient

    sent: list[tuple] = []
    client = EngineClient(config=None)
    client._cmd = SimpleNamespace(send=sent.append)
    reqs = [
        SimpleNamespace(
            request_id=f"r{i}",
            credit=StreamCredit(window=8),
            chunk_plan=None,
            cuts_at_flush=False,
            first_audio_at=1.0,
            delivered_s=0.5,
        )
        for i in range(3)
    ]
    # r1's replica sent its plan and cuts at a flush: both go to the engine, with the first grant.
    reqs[1].chunk_plan, reqs[1].cuts_at_flush = ChunkPlan(2, (4,)), True
    for r in reqs:
        client.grant(r, 16)
    client.clock_changed(reqs[0], False)
    assert sent == []  # not before the loop turn ends
    await asyncio.sleep(0)
    grants = [("grant", "r0", 16, None, False), ("grant", "r1", 16, ChunkPlan(2, (4,)), True)]
    assert sent == [("batch", grants + [("grant", "r2", 16, None, False), ("clock", "r0", 1.0, 0.5, False)])]
    assert reqs[1].credit.granted_until == 16
    # A message sent directly goes after the deferred ones, in one order.
    sent.clear()
    client.grant(reqs[2], 24)
    client.cancel("unknown")  # not submitted: nothing to send
    client.text_appended()
    assert sent == [("batch", [("grant", "r2", 24, None, False)]), ("wake",)]
    await asyncio.sleep(0)
    assert len(sent) == 2  # the scheduled flush finds nothing left


async def test_the_front_counts_its_requests_queued_in_the_engine_past_the_backlog_age(monkeypatch):
    """`EngineClient.start_counts`' third figure: requests this front submitted at least
    `StartPlanner.BACKLOG_AGE_S` ago that the engine has not admitted yet (its `Admitted` event
    ends their wait, as do their end and a cancel)."""
    from types import SimpleNamespace

    from qtts.streams.chunk_plan import StartPlanner
    from services.talker import engine_client
    from services.talker.deadline import StreamCredit
    from services.talker.engine_client import EngineClient
    from services.talker.generation_loop import Admitted, Finished

    now = [50.0]
    monkeypatch.setattr(engine_client.time, "monotonic", lambda: now[0])
    client = EngineClient(config=None)
    client._cmd = SimpleNamespace(send=lambda message: None)
    got: list = []
    reqs = {
        rid: SimpleNamespace(
            request_id=rid,
            prompt=SimpleNamespace(key=rid),
            sampling=None,
            max_new_frames=10,
            credit=StreamCredit(window=8),
            first_audio_at=None,
            loop=None,
            sink=got.append,
        )
        for rid in ("a", "b", "c")
    }
    for req in reqs.values():
        client.submit(req)
    assert client.start_counts() == (3, 3, 0)  # just submitted: between two plans
    now[0] += StartPlanner.BACKLOG_AGE_S
    assert client.start_counts() == (3, 3, 3)
    client._dispatch([("a", Admitted(0.05))])
    client.cancel("b")
    assert client.start_counts() == (2, 2, 1)
    client._dispatch([("c", Finished("length", 10))])
    assert client.start_counts() == (1, 1, 0)
    assert [type(ev) for ev in got] == [Admitted, Finished]
