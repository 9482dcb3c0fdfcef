// The playground's status strip, filled from GET /v1/status every few seconds: readiness, streams,
// the talker's queue and its mean step time since the last poll.
"use strict";

window.PlaygroundStatus = (page) => {
  const $ = (id) => document.getElementById(id);
  const { api, state, clearError, loadModel, fillLanguages } = page;

  async function pollStatus() {
    if (document.hidden) return;
    const dot = $("status-ready");
    let status;
    try {
      const resp = await api("/v1/status");
      if (!resp.ok) {
        dot.className = "dot bad";
        $("status-note").textContent = resp.status === 401 ? "API key needed" : `status: HTTP ${resp.status}`;
        return;
      }
      status = await resp.json();
    } catch (_) {
      dot.className = "dot bad";
      $("status-note").textContent = "gateway unreachable";
      return;
    }
    dot.className = status.ready ? "dot ok" : "dot bad";
    if (status.ready && !state.model && !state.loadingModel) {
      // The page was opened before the talker was up (or the key was missing): try again now.
      clearError();
      loadModel();
    }
    const g = status.gateway;
    $("status-streams").textContent = `${g.active_streams} / ${g.max_streams}`;
    $("status-requests").textContent = String(g.requests_total);
    if (status.model) fillLanguages(status.model.languages);
    const t = status.talker;
    let note = status.ready ? "" : "waiting for the talker";
    if (t && !t.error) {
      $("status-queue").textContent = String(t.queue_depth);
      const last = state.lastStep;
      const steps = last ? t.step_seconds_count - last.count : t.step_seconds_count;
      const secs = last ? t.step_seconds_sum - last.sum : t.step_seconds_sum;
      $("status-step").textContent = steps > 0 ? `${((1000 * secs) / steps).toFixed(1)} ms` : "idle";
      state.lastStep = { count: t.step_seconds_count, sum: t.step_seconds_sum };
    } else {
      $("status-queue").textContent = "n/a";
      $("status-step").textContent = "n/a";
      if (t && t.error) note = t.error;
    }
    $("status-note").textContent = note;
  }

  return pollStatus;
};
