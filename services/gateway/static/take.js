// The playground's take: one synthesis as it plays, its PCM scheduled back to back on the
// AudioContext clock, counting what it hands to Web Audio in `ui.probe` (read by the browser tests).
"use strict";

window.PlaygroundTake = (() => {
  // Scheduling margin for the first chunk and after a gap: a buffer started "now" would begin late.
  const LEAD_S = 0.03;

  /** One synthesis as it plays: PCM chunks scheduled back to back on the AudioContext clock. */
  class Take {
    constructor(ctx, mode, ui) {
      this.ui = ui; // setState, render, showError and the download button of the page
      this.probe = ui.probe;
      this.ctx = ctx;
      this.rate = 24000;
      this.t0 = performance.now();
      this.nextTime = 0;
      this.started = false;
      this.streamEnded = false;
      this.stopped = false;
      this.failed = false;
      this.carry = null;
      this.segmentStart = false;
      this.pcm = [];
      this.samples = 0;
      this.timeline = []; // [first sample, AudioContext start time, samples] per buffer (words.js)
      this.sources = new Set();
      this.out = ctx.createGain();
      this.out.connect(ctx.destination);
      this.controller = new AbortController();
      this.body = null;
      this.probe.reset(mode);
      this.ui.setState("requesting");
    }

    begin(rate) {
      this.rate = rate || 24000;
      this.probe.sampleRate = this.rate;
      this.ui.setState("streaming");
    }

    /** Raw s16le bytes as they came off the network (a sample may straddle two chunks). */
    pushBytes(chunk) {
      let bytes = chunk;
      if (this.carry !== null) {
        bytes = new Uint8Array(chunk.length + 1);
        bytes[0] = this.carry;
        bytes.set(chunk, 1);
        this.carry = null;
      }
      if (bytes.length % 2) {
        this.carry = bytes[bytes.length - 1];
        bytes = bytes.subarray(0, bytes.length - 1);
      }
      if (!bytes.length) return;
      const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
      const pcm = new Int16Array(bytes.length / 2);
      for (let i = 0; i < pcm.length; i++) pcm[i] = view.getInt16(2 * i, true);
      this.schedule(pcm);
    }

    schedule(pcm) {
      if (this.stopped) return;
      const now = this.ctx.currentTime;
      if (!this.started) {
        this.started = true;
        this.probe.ttfaMs = performance.now() - this.t0;
        this.probe.firstScheduledAt = performance.now();
        this.nextTime = now + LEAD_S;
      } else if (now > this.nextTime) {
        // Underrun: the playback clock reached the end of the buffered audio before the stream ended.
        // Typing as you go, silence before a new segment is the typist's pause, not an underrun.
        if (!this.segmentStart) {
          const gap = now - this.nextTime;
          this.probe.gaps += 1;
          this.probe.gapSeconds += gap;
          this.probe.maxGapSeconds = Math.max(this.probe.maxGapSeconds, gap);
        }
        this.nextTime = now + LEAD_S;
      }
      this.segmentStart = false;
      const floats = new Float32Array(pcm.length);
      for (let i = 0; i < pcm.length; i++) floats[i] = pcm[i] / 32768;
      const buffer = this.ctx.createBuffer(1, pcm.length, this.rate);
      buffer.copyToChannel(floats, 0);
      const src = this.ctx.createBufferSource();
      src.buffer = buffer;
      src.connect(this.out);
      src.onended = () => {
        this.sources.delete(src);
        // A stopped take's sources end after the next take has started: they say nothing.
        if (this.streamEnded && !this.sources.size && !this.failed && !this.stopped) this.ui.setState("done");
      };
      this.sources.add(src);
      src.start(this.nextTime);
      this.timeline.push([this.samples, this.nextTime, pcm.length]);
      this.nextTime += buffer.duration;
      this.pcm.push(pcm);
      this.probe.samplesBeforeLastChunk = this.samples;
      this.samples += pcm.length;
      this.probe.samplesScheduled = this.samples;
      this.probe.chunks += 1;
      this.probe.durationSeconds = this.samples / this.rate;
      this.ui.render();
    }

    finish() {
      this.streamEnded = true;
      this.probe.fetchDone = true;
      this.probe.fetchDoneAt = performance.now();
      this.ui.download.disabled = !this.samples;
      this.ui.setState(this.sources.size ? "playing out" : "done");
    }

    fail(message) {
      this.failed = true;
      this.streamEnded = true;
      this.probe.fetchDoneAt = performance.now();
      this.ui.download.disabled = !this.samples;
      this.ui.setState("error");
      this.ui.showError(message);
    }

    stop() {
      this.stopped = true;
      this.controller.abort();
      for (const src of this.sources) { try { src.stop(); } catch (_) { /* not started yet */ } }
      this.sources.clear();
      this.out.disconnect();
    }

    bufferedSeconds() {
      return this.started && !this.stopped ? Math.max(0, this.nextTime - this.ctx.currentTime) : 0;
    }

    starving() {
      return this.started && !this.streamEnded && this.ctx.currentTime > this.nextTime;
    }

    wav() {
      const data = new Uint8Array(this.samples * 2);
      let offset = 0;
      for (const pcm of this.pcm) {
        data.set(new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength), offset);
        offset += pcm.byteLength;
      }
      const header = new DataView(new ArrayBuffer(44));
      const ascii = (at, s) => { for (let i = 0; i < s.length; i++) header.setUint8(at + i, s.charCodeAt(i)); };
      ascii(0, "RIFF"); header.setUint32(4, 36 + data.length, true); ascii(8, "WAVE");
      ascii(12, "fmt "); header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, 1, true);
      header.setUint32(24, this.rate, true); header.setUint32(28, this.rate * 2, true);
      header.setUint16(32, 2, true); header.setUint16(34, 16, true);
      ascii(36, "data"); header.setUint32(40, data.length, true);
      return { header: new Uint8Array(header.buffer), data };
    }
  }

  return Take;
})();
