"""The gateway's `/health` latency while one 15 MB WebSocket `input.text` is handled (issue 28).

Starts the launcher's stack (the tiny random Base model, one code2wav replica, free ports) from
the tree in the current directory, opens a WebSocket session, and sends one `input.text` of
`--mb` MB ("word " repeated). A separate process polls `GET /health` every 20 ms from just before
the message is sent until `--watch-s` seconds after; a poll that gets no answer within the window
counts as unanswered. Prints one line of JSON: the polls, p50 / p99 / max latency in ms, the
unanswered and non-200 polls, and what the session got back (and when).

    python benchmarks/health_under_big_text.py --watch-s 20

Run it from an older checkout (`git worktree add`, stubs generated) for a before/after. CPU only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

_POLLER = """
import json, sys, time
import httpx
url, begun = sys.argv[1], time.monotonic()
until = begun + float(sys.argv[2])
seen = []
with httpx.Client() as client:
    print("polling", flush=True)
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            code = client.get(url + "/health", timeout=max(0.1, until - started)).status_code
        except Exception:
            code = 0
        seen.append((time.monotonic() - started, code, started - begun))
        time.sleep(0.02)
print(json.dumps(seen), flush=True)
"""


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(http_url: str, mb: int, watch_s: float) -> dict:
    from websockets.sync.client import connect

    from tests.e2e.e2e_helpers import REF_B64

    config = {"type": "session.config", "ref_audio": REF_B64, "x_vector_only_mode": True,
              "response_format": "pcm", "max_new_tokens": 8}  # fmt: skip
    message = json.dumps({"type": "input.text", "text": "word " * (mb * 200_000)})
    ws_url = http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    answer: dict = {}
    with connect(ws_url, max_size=None, open_timeout=30) as ws:
        ws.send(json.dumps(config))
        poller = subprocess.Popen(
            [sys.executable, "-c", _POLLER, http_url, str(watch_s)], stdout=subprocess.PIPE, text=True
        )
        assert poller.stdout.readline().strip() == "polling"
        sent = time.monotonic()

        def listen() -> None:
            while True:
                msg = ws.recv(timeout=watch_s + 5)
                if isinstance(msg, str):
                    event = json.loads(msg)
                    answer.update(type=event["type"], after_s=round(time.monotonic() - sent, 3))
                    answer["message"] = event.get("message", "")[:120]
                    return

        listener = threading.Thread(target=lambda: _quietly(listen), daemon=True)
        listener.start()
        ws.send(message)
        out, _ = poller.communicate(timeout=watch_s + 60)
        listener.join(1)
    seen = json.loads(out.strip().splitlines()[-1])
    latencies = [t for t, code, _ in seen if code]
    return {
        "polls": len(seen),
        "p50_ms": round(_quantile(latencies, 0.5) * 1e3, 1),
        "p99_ms": round(_quantile(latencies, 0.99) * 1e3, 1),
        "max_ms": round(max((t for t, _, _ in seen), default=float("nan")) * 1e3, 1),
        # The message's own second against the rest of the window (a loaded machine's noise).
        "max_ms_first_s": round(max((t for t, _, at in seen if at < 1.0), default=float("nan")) * 1e3, 1),
        "max_ms_after": round(max((t for t, _, at in seen if at >= 1.0), default=float("nan")) * 1e3, 1),
        "unanswered": sum(1 for _, code, _ in seen if not code),
        "not_200": sum(1 for _, code, _ in seen if code and code != 200),
        "session_got": answer or "nothing within the window",
    }


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a session that never answers is a result, not an error
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=15, help="size of the input.text, MB")
    parser.add_argument("--watch-s", type=float, default=10.0, help="how long /health is polled, seconds")
    args = parser.parse_args()
    from services.launcher import StackConfig, start_stack

    with tempfile.TemporaryDirectory() as logs:
        config = StackConfig.on_free_ports(code2wav_replicas=1, log_dir=Path(logs), drain_seconds=1.0)
        stack = start_stack(config)
        try:
            result = measure(stack.http_url, args.mb, args.watch_s)
        finally:
            stack.stop(grace=5.0)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(json.dumps({"revision": revision.strip(), "mb": args.mb, "watch_s": args.watch_s, **result}))


if __name__ == "__main__":
    main()
