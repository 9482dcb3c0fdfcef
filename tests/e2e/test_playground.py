"""The playground page (GET /) driven in headless Chromium against the real stack.

The page counts what it hands to Web Audio (`window.playground`): samples scheduled, the samples
scheduled before the last network chunk arrived, and when the fetch finished. Chromium is the
system one (`make test` apt-installs it); Playwright only drives it and downloads no browser. A
missing browser fails the test rather than skipping it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import httpx
import pytest
from e2e_helpers import REF_TEXT, REF_WAV, wav_frames

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR", ROOT / "test-artifacts"))
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# The tiny random model never says end-of-speech; a frame budget keeps every take short.
MAX_FRAMES = 60
TAKE_TIMEOUT_MS = 60_000


def _chromium() -> str:
    exe = os.environ.get("PLAYGROUND_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if not exe:
        pytest.fail("no Chromium on PATH (set PLAYGROUND_CHROMIUM); make test apt-installs Debian's chromium")
    return exe


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed (requirements-test.txt pins it)")
    exe = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--autoplay-policy=no-user-gesture-required"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1100, "height": 620}, accept_downloads=True)
    pg = context.new_page()
    console: list[str] = []
    pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    yield pg
    context.close()
    errors = [line for line in console if line.startswith("pageerror")]
    assert not errors, "\n".join(console)


def _probe(page) -> dict:
    return page.evaluate("({...window.playground})")


def _wait(page, expression: str, timeout_ms: float = TAKE_TIMEOUT_MS, arg=None) -> None:
    """Wait for a page condition; on timeout fail with what the page showed and counted."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(expression, arg=arg, timeout=timeout_ms)
    except PlaywrightTimeout:
        shown = {i: page.text_content(f"#{i}") for i in ("play-state", "error", "fig-ttfa", "status-note")}
        pytest.fail(f"timed out waiting for {expression!r}; page showed {shown}, counted {_probe(page)}")


def _open(page, url: str, variant: str) -> None:
    page.goto(url + "/")
    _wait(
        page,
        "v => window.playground.voicesLoaded"
        " && document.getElementById('model-variant').textContent.toLowerCase().includes(v)",
        arg=variant,
    )


def _play_and_wait(page) -> dict:
    # play() awaits the AudioContext before its take resets the state, so right after the click the
    # state can still be the last take's "done": wait for this take's body (set with the reset).
    page.evaluate("window.__lastBody = window.playground.body")
    page.click("#play")
    _wait(
        page,
        "window.playground.body !== window.__lastBody"
        " && ['done', 'playing out', 'error'].includes(window.playground.state)",
        TAKE_TIMEOUT_MS,
    )
    return _probe(page)


def test_page_streams_speech_into_web_audio_and_shows_server_errors(page, variant_gateways, tmp_path):
    gw = variant_gateways["custom_voice"]
    _open(page, gw.http_url, "customvoice")
    assert page.locator("#voice optgroup[label='Preset speakers'] option").count() > 0
    page.fill("#text", "The playground streams this sentence as it is spoken.")
    page.fill("#max-frames", str(MAX_FRAMES))
    page.fill("#seed", "7")

    p = _play_and_wait(page)
    assert p["state"] != "error", p["error"]
    # Audio reached the Web Audio graph before the response had finished.
    assert p["chunks"] >= 2, p
    assert p["samplesBeforeLastChunk"] > 0, p
    assert p["firstScheduledAt"] < p["fetchDoneAt"], p
    assert p["samplesScheduled"] == p["durationSeconds"] * p["sampleRate"] > 0
    assert re.fullmatch(r"\d+ ms", page.text_content("#fig-ttfa")), page.text_content("#fig-ttfa")
    assert page.text_content("#fig-duration").endswith(" s")
    assert re.fullmatch(r"\d+( \(\d+ ms\))?", page.text_content("#fig-gaps"))

    # The status strip is filled from /v1/status, with the talker's figures.
    _wait(page, "/^\\d+ \\/ \\d+$/.test(document.getElementById('status-streams').textContent)")
    _wait(page, "/^(\\d+)$/.test(document.getElementById('status-queue').textContent)")

    # Download as WAV: the take the page played, sample for sample.
    with page.expect_download() as dl:
        page.click("#download")
    saved = tmp_path / "take.wav"
    dl.value.save_as(saved)
    assert wav_frames(saved.read_bytes()) == p["samplesScheduled"]

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)

    # A bad input shows the server's own message.
    page.fill("#speed", "9")
    p = _play_and_wait(page)
    assert p["state"] == "error"
    r = httpx.post(gw.http_url + "/v1/audio/speech", json=p["body"], timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "speed" in message
    assert page.locator("#error").is_visible()
    assert page.text_content("#error") == message == p["error"]


def test_upload_a_clip_as_a_voice_and_play_with_it(page, stack):
    name = f"pw-{uuid.uuid4().hex[:8]}"
    _open(page, stack.http_url, "base")
    assert page.locator("#upload").is_visible()
    if page.get_attribute("#upload", "open") is None:
        page.click("#upload summary")
    page.fill("#upload-name", name)
    page.set_input_files("#upload-file", {"name": "clip.wav", "mimeType": "audio/wav", "buffer": REF_WAV})
    page.fill("#upload-text", REF_TEXT)
    page.click("#upload-button")
    _wait(page, "document.getElementById('upload-result').textContent.startsWith('stored')", 60_000)
    try:
        assert page.input_value("#voice") == name
        voice = httpx.get(f"{stack.http_url}/v1/audio/voices/{name}", timeout=10).json()
        assert voice["ref_text"] == REF_TEXT and voice["duration_s"] > 1.0

        page.fill("#text", "Now in the voice I just uploaded.")
        page.fill("#max-frames", "24")
        p = _play_and_wait(page)
        assert p["state"] != "error", p["error"]
        assert p["body"]["voice"] == name
        assert p["samplesScheduled"] > 0 and p["ttfaMs"] > 0
    finally:
        httpx.delete(f"{stack.http_url}/v1/audio/voices/{name}", timeout=10)


def test_type_as_you_go_streams_text_over_the_websocket_when_the_endpoint_exists(page, variant_gateways):
    _open(page, variant_gateways["custom_voice"].http_url, "customvoice")
    _wait(page, "window.playground.liveProbe !== 'pending'", 10_000)
    if _probe(page)["liveProbe"] != "open":
        # A gateway without /v1/audio/speech/stream: the mode is not offered at all.
        assert not page.locator("#live-mode-label").is_visible()
        return
    page.check("#live-mode")
    page.fill("#max-frames", "12")
    # The server cuts a segment at a clause mark once the text goes on after it.
    page.fill("#text", "The first clause, and")
    page.click("#play")
    _wait(page, "window.playground.samplesScheduled > 0")  # audio before the text is complete
    page.evaluate(
        "() => { const t = document.getElementById('text'); t.value += ' then a second one.';"
        " t.dispatchEvent(new Event('input')); }"
    )
    page.click("#live-done")
    _wait(page, "['done', 'playing out', 'error'].includes(window.playground.state)")
    p = _probe(page)
    assert p["state"] != "error", p["error"]
    assert p["mode"] == "ws" and p["fetchDone"] and p["segments"] == 2 and p["samplesScheduled"] > 0


# ---- word timestamps: the words light up as they are heard ----------------------------------------


@pytest.fixture(scope="module")
def aligned_gateway(snapshot_root, tmp_path_factory):
    """A CustomVoice stack (preset speakers: nothing to upload) with the aligner stage."""
    from e2e_helpers import running_stack, tiny_snapshot, tiny_stack_config

    from services.launcher import free_port

    config = tiny_stack_config(
        snapshot_root,
        tmp_path_factory.mktemp("logs-playground-aligner"),
        model=str(tiny_snapshot(snapshot_root, "custom_voice")),
        aligner_port=free_port(),
        aligner_metrics_port=free_port(),
    )
    with running_stack(config) as started:
        yield started


ALL_LIT = (
    "window.playground.words.length > 0"
    " && window.playground.wordsLit === window.playground.words.length"
    " && ['done', 'error'].includes(window.playground.state)"
)


def test_words_light_up_in_order_as_the_sse_take_plays(page, aligned_gateway):
    _open(page, aligned_gateway.http_url, "customvoice")
    page.check("#word-timestamps")
    page.fill("#text", "Words light up as they are heard.")
    page.fill("#max-frames", "40")
    page.fill("#seed", "3")
    p = _play_and_wait(page)
    assert p["state"] != "error", p["error"]
    assert p["body"]["stream_format"] == "sse" and p["body"]["word_timestamps"] is True
    assert p["samplesScheduled"] > 0 and p["timestampEvents"] == 1 and p["timestampFailures"] == 0
    _wait(page, ALL_LIT)
    p = _probe(page)
    assert [w["word"] for w in p["words"]] == ["Words", "light", "up", "as", "they", "are", "heard"]
    # Lit one after the other, as the playback clock passed each start.
    assert p["litOrder"] == list(range(7))
    assert page.locator("#words-panel").is_visible()
    assert page.locator("#words .word.heard").count() == 7 and page.locator("#words .word.now").count() == 0
    # The page shows the server's words for this take (the same seed gives the same take).
    r = httpx.post(aligned_gateway.http_url + "/v1/audio/speech", json=p["body"], timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    (stamps,) = [e["timestamps"] for e in events if e["type"] == "speech.audio.timestamps"]
    assert [{**w, "utterance": 0} for w in stamps] == p["words"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground-words.png"), full_page=True)

    # Without the box the take is raw PCM again and the words panel is hidden.
    page.uncheck("#word-timestamps")
    p = _play_and_wait(page)
    assert "word_timestamps" not in p["body"] and "stream_format" not in p["body"]
    assert p["words"] == [] and not page.locator("#words-panel").is_visible()


def test_words_of_each_segment_light_up_when_typing_as_you_go(page, aligned_gateway):
    _open(page, aligned_gateway.http_url, "customvoice")
    _wait(page, "window.playground.liveProbe === 'open'", 10_000)
    page.check("#live-mode")
    page.check("#word-timestamps")
    page.fill("#max-frames", "16")
    page.fill("#text", "Hello there, how are you today?")
    page.click("#play")
    _wait(page, "window.playground.samplesScheduled > 0")
    page.click("#live-done")
    _wait(page, ALL_LIT)
    p = _probe(page)
    assert p["state"] != "error", p["error"]
    assert p["mode"] == "ws" and p["segments"] == 2 and p["timestampEvents"] == 2
    assert [w["word"] for w in p["words"]] == ["Hello", "there", "how", "are", "you", "today"]
    assert p["litOrder"] == list(range(6))


def test_word_clock_follows_the_scheduled_audio_and_lights_words_only_once_heard(page, aligned_gateway):
    _open(page, aligned_gateway.http_url, "customvoice")
    got = page.evaluate(
        """() => {
        const W = window.PlaygroundWords;
        // Two buffers of 0.5 s (rate 1000), the second after a 1.5 s gap on the clock.
        const take = { rate: 1000, samples: 1000, stopped: false, ctx: { currentTime: 0 },
                       timeline: [[0, 10, 500], [500, 12, 500]] };
        const clock = [0, 250, 500, 750, 1000, 1001].map((s) => W.clockTime(take, s));
        const box = document.createElement("div");
        document.createElement("div").append(box);
        const probe = {};
        const track = new W.WordTrack(box, document.createElement("div"), probe);
        track.reset(take, true);
        track.add([{ word: "a", start_ms: 0, end_ms: 300 }, { word: "b", start_ms: 400, end_ms: 600 },
                   { word: "c", start_ms: 700, end_ms: 900 }, { word: "d", start_ms: 5000, end_ms: 6000 }]);
        const seen = [];
        const look = () => seen.push([...box.querySelectorAll(".word")].map(
            (s) => (s.classList.contains("heard") ? "H" : "-") + (s.classList.contains("now") ? "N" : "")).join(" "));
        for (const t of [9.9, 10.1, 10.45, 12.05, 12.3, 12.5]) { take.ctx.currentTime = t; track.tick(); look(); }
        return { clock, seen, lit: probe.wordsLit, order: probe.litOrder };
    }"""
    )
    assert got["clock"] == [10, 10.25, 12, 12.25, 12.5, None]
    # b starts at 0.4 s (clock 10.4) and ends in the second buffer (clock 12.1): during the gap
    # it stays the word being heard; c starts at 12.2. d, timed past the audio it came after, is
    # heard when that audio ends (12.5).
    assert got["seen"] == ["- - - -", "HN - - -", "H HN - -", "H HN - -", "H H HN -", "H H H H"]
    assert got["lit"] == 4 and got["order"] == [0, 1, 2, 3]


def test_a_refused_word_timestamps_request_shows_the_servers_message(page, aligned_gateway):
    _open(page, aligned_gateway.http_url, "customvoice")
    # The tiny model lists Korean (from its config), which the aligner cannot split into words.
    _wait(page, "[...document.querySelectorAll('#language option')].some(o => o.value === 'korean')")
    page.select_option("#language", "korean")
    page.check("#word-timestamps")
    p = _play_and_wait(page)
    assert p["state"] == "error" and "word_timestamps" in p["error"], p["error"]
    assert page.text_content("#error") == p["error"]
