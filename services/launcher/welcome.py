"""What the launcher prints once the stack is up: where everything listens, who may use it, and a
`curl` line that produces a wav (with a demo voice made for a Base model)."""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request
import wave

from services.launcher.config import StackConfig
from services.launcher.stack import Stack


def _tone_wav(seconds: float = 2.0, rate: int = 24000) -> bytes:
    """A short synthetic clip, so the demo voice needs no file from the user."""
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * (180 + 60 * np.sin(2 * np.pi * 1.5 * t)) * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw or b"{}")
        except ValueError:
            return exc.code, {"error": raw.decode(errors="replace")}


def demo_request(stack: Stack) -> dict:
    """A speech request body that works with the served variant (creates a demo voice for Base)."""
    _, models = _http_json(f"{stack.http_url}/v1/models")
    info = models["data"][0]
    # No length field: the tiny default model declares a default length (qtts.tiny_model), as it
    # never says end of speech by itself.
    body = {"model": info["id"], "input": "Hello from the Qwen3 TTS stack.", "response_format": "wav"}
    if info.get("model_type") == "custom_voice":
        _, voices = _http_json(f"{stack.http_url}/v1/audio/voices")
        presets = [v["name"] for v in voices["voices"] if v["kind"] == "preset"]
        body["voice"] = presets[0] if presets else "vivian"
    elif info.get("model_type") == "voice_design":
        body["instructions"] = "A warm, calm female voice."
    else:
        status, resp = _http_json(
            f"{stack.http_url}/v1/audio/voices",
            {
                "name": "demo",
                "audio": base64.b64encode(_tone_wav()).decode(),
                "x_vector_only_mode": True,
            },
        )
        if status not in (201, 409):  # 409: kept from an earlier run (Redis)
            raise ValueError(f"creating the demo voice failed ({status}): {resp.get('error', resp)}")
        body["voice"] = "demo"
    return body


def access_note(c: StackConfig) -> str:
    """Who can use the stack, said plainly: `make run` is open (no API keys, no internal token),
    which is safe on loopback only."""
    keys = any(a.startswith("--api-keys") for a in c.extra_args.get("gateway", ()))
    loopback = c.host in ("127.0.0.1", "localhost", "::1")
    if keys:
        return "API keys required (--api-keys-file); " + ("loopback only" if loopback else f"on {c.host}")
    if loopback:
        return "open: no API keys, no internal token, no TLS, on loopback (127.0.0.1) only"
    return (
        f"WARNING: open on {c.host}: no API keys, so anyone who reaches it can use it "
        "(--gateway-args '--api-keys-file FILE')"
    )


def describe(stack: Stack, body: dict) -> str:
    c = stack.config
    lines = [
        "Qwen3-TTS stack is up:",
        f"  gateway        HTTP {stack.http_url}   gRPC {stack.grpc_address} (tts.v1)",
        *[
            f"  {p.name:<14} HTTP {url}"
            for p, url in zip(
                [p for p in stack.processes if p.name.startswith("gateway-")],
                stack.http_urls[1:],
                strict=True,
            )
        ],
        f"  talker         {c.address(c.talker_port)}",
        *[f"  {p.name:<14} {p.spec.grpc_address}" for p in stack.processes if p.name.startswith("code2wav")],
        f"  speaker_cache  {c.address(c.speaker_cache_port)}"
        f" ({'redis ' + c.redis_url if c.redis_url else 'in-memory'})",
        *([f"  aligner        {c.address(c.aligner_port)} (word timestamps)"] if c.aligner_port else []),
        "  metrics        "
        + ", ".join(f"{p.name}:{p.spec.metrics_port}" for p in stack.processes if p.spec.metrics_port),
        f"  model          {stack.model}",
        f"  logs           {c.log_dir}/",
        f"  access         {access_note(c)}",
        "",
        f"Playground (type, pick a voice, hear it stream): {stack.http_url}/",
        "",
        "Try:",
        f"  curl -s {stack.http_url}/v1/audio/speech -H 'Content-Type: application/json' "
        f"-d '{json.dumps(body)}' -o hello.wav",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
