// The playground's word timestamps: the words of a take light up as they are heard.
// The server sends each word's start and end in ms of the audio it sent (HTTP: one
// speech.audio.timestamps SSE event after the audio; WebSocket: per segment in audio.done, from the
// start of its utterance). The take logs where each buffer went on the AudioContext clock
// (take.timeline: [first sample, start time, samples]), so a word's audio position maps to the
// moment it plays, gaps and typing pauses included; a word lights when the clock passes its start.
"use strict";

window.PlaygroundWords = (() => {
  /** The AudioContext time at which `sample` (of the take's audio) plays; null if not scheduled yet. */
  function clockTime(take, sample) {
    const tl = take.timeline;
    let lo = 0;
    let hi = tl.length - 1;
    if (hi < 0 || sample < tl[0][0]) return null;
    while (lo < hi) { // the last buffer that starts at or before `sample`
      const mid = (lo + hi + 1) >> 1;
      if (tl[mid][0] <= sample) lo = mid; else hi = mid - 1;
    }
    const [first, start, samples] = tl[lo];
    if (sample > first + samples) return null;
    return start + (sample - first) / take.rate;
  }

  class WordTrack {
    constructor(box, note, probe) {
      this.box = box;
      this.note = note;
      this.probe = probe;
      this.take = null;
      this.words = [];
      this.bases = {};
      this.frame = null;
    }

    /** A new take: clear the words; `on` says whether this take asked for timestamps. */
    reset(take, on) {
      this.take = take;
      this.words = [];
      this.bases = {};
      this.box.replaceChildren();
      this.note.textContent = on ? "the words follow the audio and light up as they are heard" : "";
      this.box.parentElement.hidden = !on;
      Object.assign(this.probe, { words: [], wordsLit: 0, litOrder: [], timestampEvents: 0, timestampFailures: 0 });
    }

    /** WebSocket: a segment of utterance `u` starts; its words count from the utterance's first sample. */
    segmentStart(u) {
      if (this.take && !(u in this.bases)) this.bases[u] = this.take.samples;
    }

    /** Timed words ({word, start_ms, end_ms}) of utterance `u` (HTTP: 0); null: the aligner failed. */
    add(timestamps, u = 0) {
      const take = this.take;
      if (!take) return;
      this.probe.timestampEvents += 1;
      if (!Array.isArray(timestamps)) {
        this.probe.timestampFailures += 1;
        this.note.textContent = "the server could not time some of the words (the audio is whole)";
        return;
      }
      const base = this.bases[u] || 0;
      // The words come after their audio: a time past it (the aligner's last slots may overshoot)
      // is heard when that audio ends, not in whatever plays next.
      const last = take.samples;
      const at = (ms) => Math.min(last, base + Math.round((ms * take.rate) / 1000));
      for (const w of timestamps) {
        const span = document.createElement("span");
        span.textContent = w.word;
        span.className = "word";
        span.title = `${(w.start_ms / 1000).toFixed(2)}–${(w.end_ms / 1000).toFixed(2)} s`;
        this.box.append(span, " ");
        this.words.push({
          ...w, span, lit: false,
          start: at(w.start_ms),
          end: at(w.end_ms),
        });
        this.probe.words.push({ word: w.word, start_ms: w.start_ms, end_ms: w.end_ms, utterance: u });
      }
      this.tick();
    }

    /** Light every word whose start the playback clock has passed; mark the one playing now. */
    tick() {
      this.frame = null;
      const take = this.take;
      if (!take || take.stopped) return;
      const now = take.ctx.currentTime;
      let pending = false;
      this.words.forEach((w, i) => {
        const start = clockTime(take, w.start);
        const end = clockTime(take, w.end);
        if (!w.lit) {
          if (start === null || now < start) { pending = true; return; }
          w.lit = true;
          w.span.classList.add("heard");
          this.probe.wordsLit += 1;
          this.probe.litOrder.push(i);
        }
        const playing = end !== null && now < end;
        w.span.classList.toggle("now", playing);
        pending = pending || playing;
      });
      if (pending) this.frame = requestAnimationFrame(() => this.tick());
    }
  }

  /** Read an SSE body (`data: {json}` events), calling onEvent(payload) for each. */
  async function readSse(reader, onEvent) {
    const decoder = new TextDecoder();
    let text = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      text += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = text.indexOf("\n\n")) >= 0) {
        const event = text.slice(0, cut);
        text = text.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data) onEvent(JSON.parse(data));
      }
    }
  }

  function base64Bytes(b64) {
    const raw = atob(b64);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }

  return { WordTrack, clockTime, readSse, base64Bytes };
})();
