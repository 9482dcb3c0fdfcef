// The gateway's playground: streams POST /v1/audio/speech as raw PCM (24 kHz s16le unless the server
// says otherwise in x-tts-sample-rate) into Web Audio as it arrives, and shows how well it streamed.
// Plain JavaScript, no build step, nothing fetched from outside the gateway.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = "qtts-playground-api-key";
  const STATUS_POLL_MS = 2000;
  const METER_FULL_S = 2.0;
  const VARIANTS = {
    base: "Base · voice clone",
    custom_voice: "CustomVoice · preset speakers",
    voice_design: "VoiceDesign · described voice",
  };

  // What reached the Web Audio graph, and when (performance.now() ms): read by the browser tests.
  const probe = {
    liveProbe: "pending", // "open" when the WebSocket endpoint answered, "failed" when it did not
    reset(mode) {
      Object.assign(this, {
        mode, state: "requesting", error: null, sampleRate: null, ttfaMs: null, chunks: 0,
        samplesScheduled: 0, samplesBeforeLastChunk: 0, firstScheduledAt: null, fetchDone: false,
        fetchDoneAt: null, segments: 0, gaps: 0, gapSeconds: 0, maxGapSeconds: 0, durationSeconds: 0,
      });
    },
  };
  probe.reset(null);
  probe.state = "idle";
  window.playground = probe;

  const state = { model: null, languages: [], ctx: null, take: null, live: null, lastStep: null };
  const Take = window.PlaygroundTake;
  const Words = window.PlaygroundWords;
  const words = new Words.WordTrack($("words"), $("words-note"), probe);

  // ---- HTTP helpers ----------------------------------------------------------------------------

  function authHeaders(extra = {}) {
    const key = $("api-key").value.trim();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  }

  function api(path, opts = {}) {
    return fetch(path, { ...opts, headers: authHeaders(opts.headers || {}) });
  }

  // The server's own message (OpenAI's error shape), never a generic one.
  async function errorMessage(resp) {
    let text = "";
    try { text = await resp.text(); } catch (_) { /* body unreadable: status only */ }
    let message = null;
    try {
      const body = JSON.parse(text);
      message = (body && body.error && body.error.message) || (typeof body.detail === "string" ? body.detail : null);
    } catch (_) { /* not JSON */ }
    message = message || (text ? `${resp.status} ${resp.statusText}: ${text.slice(0, 300)}` : `${resp.status} ${resp.statusText}`);
    if (resp.status === 401 || resp.status === 403) message += "  (enter an API key below)";
    return message;
  }

  function showError(message) {
    const box = $("error");
    box.textContent = message;
    box.hidden = false;
    probe.error = message;
  }

  function clearError() {
    $("error").hidden = true;
    $("error").textContent = "";
  }

  // ---- model, voices, languages ----------------------------------------------------------------

  async function loadModel() {
    state.loadingModel = true;
    try { await fetchModel(); } finally { state.loadingModel = false; }
  }

  async function fetchModel() {
    let resp;
    try { resp = await api("/v1/models"); } catch (e) { showError(`gateway unreachable: ${e.message}`); return; }
    if (!resp.ok) { showError(await errorMessage(resp)); return; }
    const info = (await resp.json()).data[0];
    state.model = info;
    $("model-name").textContent = info.id;
    $("model-variant").textContent = [VARIANTS[info.model_type] || info.model_type, info.model_size].filter(Boolean).join(" · ");
    const design = info.model_type === "voice_design";
    $("voice-row").hidden = design;
    $("instructions-row").hidden = !(design || info.model_type === "custom_voice");
    $("upload").hidden = info.model_type !== "base";
    if (info.model_size === "tiny" && !$("max-frames").value) {
      // The tiny random test model never says end-of-speech: without a budget it runs to the text cap.
      $("max-frames").value = "40";
    }
    await loadVoices();
  }

  async function loadVoices(select) {
    const resp = await api("/v1/audio/voices");
    if (!resp.ok) { showError(await errorMessage(resp)); return; }
    const voices = (await resp.json()).voices;
    const type = state.model && state.model.model_type;
    const groups = [];
    if (type !== "base") groups.push(["Preset speakers", voices.filter((v) => v.kind === "preset")]);
    if (type !== "custom_voice") groups.push(["Stored voices", voices.filter((v) => v.kind !== "preset")]);
    const box = $("voice");
    const previous = select || box.value;
    box.replaceChildren();
    for (const [label, list] of groups) {
      if (!list.length) continue;
      const group = document.createElement("optgroup");
      group.label = label;
      for (const v of list) {
        const opt = new Option(v.kind === "preset" ? v.name : `${v.name} (${v.duration_s.toFixed(1)} s${v.x_vector_only_mode ? ", x-vector" : ""})`, v.name);
        opt.dataset.kind = v.kind;
        group.append(opt);
      }
      box.append(group);
    }
    if (!box.options.length) {
      box.append(new Option(type === "base" ? "no stored voice yet: upload one below" : "no voice", ""));
      if (type === "base") $("upload").open = true;
    }
    if ([...box.options].some((o) => o.value === previous)) box.value = previous;
    voiceChanged();
    probe.voicesLoaded = true;
  }

  function voiceChanged() {
    const opt = $("voice").selectedOptions[0];
    $("voice-delete").hidden = !(opt && opt.dataset.kind && opt.dataset.kind !== "preset");
  }

  async function deleteVoice() {
    const name = $("voice").value;
    if (!name || !confirm(`Delete the stored voice ${name}?`)) return;
    const resp = await api(`/v1/audio/voices/${encodeURIComponent(name)}`, { method: "DELETE" });
    if (!resp.ok) { showError(await errorMessage(resp)); return; }
    await loadVoices();
  }

  async function uploadVoice(event) {
    event.preventDefault();
    clearError();
    const file = $("upload-file").files[0];
    const name = $("upload-name").value.trim();
    const form = new FormData();
    form.append("name", name);
    if (file) form.append("audio_sample", file, file.name);
    const transcript = $("upload-text").value.trim();
    if (transcript) form.append("ref_text", transcript);
    $("upload-button").disabled = true;
    $("upload-result").textContent = "uploading…";
    try {
      const resp = await api("/v1/audio/voices", { method: "POST", body: form });
      if (!resp.ok) { $("upload-result").textContent = ""; showError(await errorMessage(resp)); return; }
      const voice = await resp.json();
      await loadVoices(voice.name);
      $("upload-result").textContent = `stored ${voice.name} (${voice.duration_s.toFixed(1)} s)`;
    } catch (e) {
      $("upload-result").textContent = "";
      showError(`upload failed: ${e.message}`);
    } finally {
      $("upload-button").disabled = false;
    }
  }

  function fillLanguages(languages) {
    if (!languages || languages.join() === state.languages.join()) return;
    state.languages = languages;
    const box = $("language");
    const previous = box.value;
    box.replaceChildren(new Option("auto", ""), ...languages.map((l) => new Option(l, l)));
    box.value = languages.includes(previous) ? previous : "";
  }

  // The request as the form describes it (empty fields are left to the server's defaults).
  function requestFields() {
    const body = {};
    if (state.model) body.model = state.model.id;
    const type = state.model && state.model.model_type;
    if (type !== "voice_design" && $("voice").value) body.voice = $("voice").value;
    if ($("language").value) body.language = $("language").value;
    if (!$("instructions-row").hidden && $("instructions").value.trim()) body.instructions = $("instructions").value.trim();
    for (const [id, field] of [["speed", "speed"], ["seed", "seed"], ["max-frames", "max_new_tokens"]]) {
      const raw = $(id).value.trim();
      if (raw !== "") body[field] = Number(raw);
    }
    return body;
  }

  // ---- playback --------------------------------------------------------------------------------

  async function audioContext() {
    if (!state.ctx) state.ctx = new (window.AudioContext || window.webkitAudioContext)();
    if (state.ctx.state !== "running") await state.ctx.resume();
    return state.ctx;
  }

  function takeUi() {
    return { probe, setState, render, showError, download: $("download") };
  }

  function setState(text) {
    probe.state = text;
    const busy = text === "requesting" || text === "streaming";
    $("play").disabled = busy;
    $("stop").disabled = !(busy || text === "playing out");
    render();
  }

  async function play() {
    clearError();
    if ($("live-mode").checked) { startLive(); return; }
    stopTake();
    const ctx = await audioContext();
    const take = state.take = new Take(ctx, "http", takeUi());
    take.body = probe.body = { ...requestFields(), input: $("text").value, response_format: "pcm", stream: true };
    // Word timestamps come over SSE: audio deltas, then the words of the audio sent.
    const timed = $("word-timestamps").checked;
    if (timed) Object.assign(take.body, { stream_format: "sse", word_timestamps: true });
    words.reset(take, timed);
    let resp;
    try {
      resp = await api("/v1/audio/speech", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(take.body), signal: take.controller.signal,
      });
    } catch (e) {
      if (!take.stopped) take.fail(`request failed: ${e.message}`);
      return;
    }
    if (!resp.ok) { take.fail(await errorMessage(resp)); return; }
    take.begin(Number(resp.headers.get("x-tts-sample-rate")));
    const requestId = resp.headers.get("x-request-id");
    const reader = resp.body.getReader();
    try {
      if (timed) {
        await Words.readSse(reader, (event) => {
          if (event.type === "speech.audio.delta") take.pushBytes(Words.base64Bytes(event.audio));
          else if (event.type === "speech.audio.timestamps") words.add(event.timestamps);
          else if (event.type === "error") {
            throw Object.assign(new Error("error event"), { serverMessage: (event.error && event.error.message) || JSON.stringify(event) });
          }
        });
      } else {
        for (;;) {
          const { done, value } = await reader.read();
          if (done) break;
          take.pushBytes(value);
        }
      }
    } catch (e) {
      // A raw audio body that fails after its first byte is aborted by the server, which has no way
      // left to send its message; the request id names the request to whoever reads the server side.
      if (!take.stopped) {
        take.fail(e.serverMessage || `the server aborted the stream after ${(take.samples / take.rate).toFixed(2)} s of audio`
          + ` (request ${requestId || "?"}; ${e.message})`);
      }
      return;
    }
    take.finish();
  }

  function stopTake() {
    if (state.live) stopLive();
    if (state.take) {
      const take = state.take;
      take.stop();
      if (!take.streamEnded) { take.streamEnded = true; setState("stopped"); }
      else if (probe.state === "playing out") setState("stopped");
    }
  }

  async function download() {
    const take = state.take;
    if (!take) return;
    const fmt = $("format").value;
    let blob;
    if (fmt === "wav" || fmt === "pcm") {
      const { header, data } = take.wav();
      blob = new Blob(fmt === "wav" ? [header, data] : [data], { type: fmt === "wav" ? "audio/wav" : "audio/pcm" });
    } else {
      // Another container means another synthesis of the same request (the same seed gives the same take).
      const body = { ...(take.body || { ...requestFields(), input: $("text").value }), response_format: fmt, stream: false };
      delete body.stream_format;
      delete body.word_timestamps; // the file, not a JSON answer with the words
      $("download").disabled = true;
      try {
        const resp = await api("/v1/audio/speech", {
          method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        });
        if (!resp.ok) { showError(await errorMessage(resp)); return; }
        blob = await resp.blob();
      } finally {
        $("download").disabled = false;
      }
    }
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = `speech.${fmt}`;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 30000);
  }

  // ---- type as you go (WebSocket /v1/audio/speech/stream, when the server has it) ---------------

  function wsUrl() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    // A browser cannot set headers on a WebSocket: the gateway takes the key as a query parameter.
    const key = $("api-key").value.trim();
    const query = key ? `?api_key=${encodeURIComponent(key)}` : "";
    return `${scheme}//${location.host}/v1/audio/speech/stream${query}`;
  }

  // Show the mode only when the endpoint answers; a server without it simply has no such mode.
  function probeLive() {
    let ws;
    try { ws = new WebSocket(wsUrl()); } catch (_) { probe.liveProbe = "failed"; return; }
    const give_up = setTimeout(() => { probe.liveProbe = "failed"; ws.close(); }, 3000);
    ws.onopen = () => {
      clearTimeout(give_up);
      probe.liveProbe = "open";
      $("live-mode-label").hidden = false;
      ws.close(1000, "probe");
    };
    ws.onerror = () => { clearTimeout(give_up); if (probe.liveProbe === "pending") probe.liveProbe = "failed"; };
  }

  async function startLive() {
    stopTake();
    const ctx = await audioContext();
    const take = state.take = new Take(ctx, "ws", takeUi());
    const ws = new WebSocket(wsUrl());
    ws.binaryType = "arraybuffer";
    const live = state.live = { ws, take, sent: "", timer: null, done: false };
    take.body = { ...requestFields(), input: $("text").value, response_format: "pcm" };
    const timed = $("word-timestamps").checked;
    words.reset(take, timed);
    $("live-done").hidden = false;
    ws.onopen = () => {
      // Raw PCM as it is produced; the server cuts the text at clauses and speaks each as it completes.
      ws.send(JSON.stringify({
        type: "session.config", ...requestFields(), response_format: "pcm", stream_audio: true,
        split_granularity: "clause", ...(timed ? { word_timestamps: true } : {}),
      }));
      take.begin(24000);
      take.t0 = performance.now();
      sendLiveText();
    };
    ws.onmessage = (event) => {
      if (typeof event.data !== "string") { take.pushBytes(new Uint8Array(event.data)); return; }
      let msg;
      try { msg = JSON.parse(event.data); } catch (_) { return; }
      if (msg.type === "audio.start") {
        take.begin(msg.sample_rate);
        take.segmentStart = true;
        probe.segments += 1;
        words.segmentStart(msg.utterance_index);
      } else if (msg.type === "audio.done" && "timestamps" in msg) {
        words.add(msg.timestamps, msg.utterance_index);
      } else if (msg.type === "session.done") {
        live.done = true;
        take.finish();
        ws.close(1000);
      } else if (msg.type === "error") {
        take.fail(msg.message || (msg.error && msg.error.message) || JSON.stringify(msg));
      }
    };
    ws.onclose = (event) => {
      if (!live.done && !take.streamEnded && !take.stopped) {
        take.fail(`the WebSocket closed (${event.code}${event.reason ? `: ${event.reason}` : ""}) before the session ended`);
      }
      if (state.live === live) finishLiveUi();
    };
  }

  // The text appended since the last send goes out as one input.text piece.
  function sendLiveText() {
    const live = state.live;
    if (!live || live.ws.readyState !== WebSocket.OPEN) return;
    const text = $("text").value;
    if (!text.startsWith(live.sent)) {
      $("play-state").textContent = "only appended text is sent while typing";
      live.sent = text.slice(0, live.sent.length);
      return;
    }
    const piece = text.slice(live.sent.length);
    if (!piece) return;
    live.ws.send(JSON.stringify({ type: "input.text", text: piece }));
    live.sent = text;
  }

  function textTyped() {
    const live = state.live;
    if (!live) return;
    clearTimeout(live.timer);
    live.timer = setTimeout(sendLiveText, 200);
  }

  function finishLive() {
    const live = state.live;
    if (!live || live.ws.readyState !== WebSocket.OPEN) return;
    sendLiveText();
    live.ws.send(JSON.stringify({ type: "input.done" }));
    live.ws.send(JSON.stringify({ type: "session.close" }));
    $("live-done").hidden = true;
  }

  function stopLive() {
    const live = state.live;
    state.live = null;
    if (live && live.ws.readyState <= WebSocket.OPEN) live.ws.close(1000, "stopped");
    finishLiveUi();
  }

  function finishLiveUi() {
    $("live-done").hidden = true;
  }

  // ---- figures and status strip ----------------------------------------------------------------

  function render() {
    const take = state.take;
    $("fig-ttfa").textContent = probe.ttfaMs === null ? "–" : `${Math.round(probe.ttfaMs)} ms`;
    const buffered = take ? take.bufferedSeconds() : 0;
    $("fig-buffered").textContent = take && take.started ? `${buffered.toFixed(2)} s` : "–";
    $("buffer-bar").style.width = `${Math.min(100, (100 * buffered) / METER_FULL_S)}%`;
    $("fig-gaps").textContent = !take || !take.started ? "–"
      : probe.gaps ? `${probe.gaps} (${Math.round(probe.gapSeconds * 1000)} ms)` : "0";
    $("fig-duration").textContent = take && take.started ? `${probe.durationSeconds.toFixed(2)} s` : "–";
    let text = probe.state;
    if (take && take.starving()) text = "streaming: starved, waiting for audio";
    if (probe.state === "idle") text = "idle";
    $("play-state").textContent = text;
  }

  const pollStatus = window.PlaygroundStatus({ api, state, clearError, loadModel, fillLanguages });

  // ---- wiring ----------------------------------------------------------------------------------

  function init() {
    const key = $("api-key");
    key.value = sessionStorage.getItem(KEY_STORAGE) || "";
    key.addEventListener("change", () => {
      sessionStorage.setItem(KEY_STORAGE, key.value.trim());
      clearError();
      loadModel();
      pollStatus();
    });
    $("play").addEventListener("click", play);
    $("stop").addEventListener("click", stopTake);
    $("download").addEventListener("click", download);
    $("voice").addEventListener("change", voiceChanged);
    $("voice-delete").addEventListener("click", deleteVoice);
    $("upload-form").addEventListener("submit", uploadVoice);
    $("text").addEventListener("input", textTyped);
    $("live-done").addEventListener("click", finishLive);
    $("live-mode").addEventListener("change", () => { if (!$("live-mode").checked) stopLive(); });
    setInterval(render, 100);
    setInterval(pollStatus, STATUS_POLL_MS);
    loadModel();
    pollStatus();
    probeLive();
  }

  init();
})();
