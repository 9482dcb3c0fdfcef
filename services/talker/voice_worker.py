"""The talker's voice encoders in a process of their own (spawned: it owns its CUDA context).

A new voice's prompt used to be computed in the engine process, on the engine's prompt thread:
queued behind the prompt builds, sharing a GIL with the thread that drives the frame steps, its
kernels queued on the engine's CUDA stream behind each step, and one voice at a time from the
front. 16 ms alone took 432 ms under load. Here only the speaker and codec encoders are loaded
(`qtts.model.voice_encoders`), fed clips and returning arrays; nothing else runs in the process.

Two pipes of pickled tuples:
- front -> worker: `("compute", [(pcm_f32, ref_text, x_vector_only), ...])`, `("stop",)`;
- worker -> front: `("ready", pid, fingerprint)` or `("start_failed", message)` once, then one
  `("done", [result, ...])` per compute: `("ok", x_vector_f32, codes_i16 | None)` or
  `("error", "invalid" | "failed", message)` for each clip.

A fatal device error ends the process after its answer; the front starts a new one for the next
batch. When the process dies before it answers, the batch's clips are computed again one by one,
each in a live process (started anew if need be): a clip that kills it twice fails alone.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from qtts.request.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

# After a failed start, requests fail at once for this long instead of each waiting for a start.
RESTART_BACKOFF_S = 10.0


@dataclass(frozen=True)
class VoiceWorkerSpec:
    """What the worker loads: the talker's model, device and dtype."""

    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    load_format: str = "auto"
    max_batch: int = 16
    torch_threads: int = 2  # the mel front-end runs on the host
    start_timeout_s: float = 600.0

    @classmethod
    def from_config(cls, config: Any) -> VoiceWorkerSpec:
        return cls(
            model_path=str(config.model_path),
            device=config.device,
            dtype=config.dtype,
            load_format=config.load_format,
        )


def worker_main(conn_in: Any, conn_out: Any, spec: VoiceWorkerSpec) -> None:
    """The worker process's body: load the encoders, then answer computes until "stop" or the
    front goes away (its end of the pipe closing)."""
    import signal

    # Ctrl-C reaches the whole process group: the front stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s voice-worker %(levelname)s %(message)s")
    try:
        import torch

        from qtts.model.voice_encoders import load_voice_encoders

        torch.set_num_threads(spec.torch_threads)
        encoders = load_voice_encoders(
            spec.model_path,
            device=spec.device,
            dtype=getattr(torch, spec.dtype),
            load_format=spec.load_format,
        )
        encoders.max_batch = spec.max_batch
        fingerprint = encoders.fingerprint()
        _warm_up(encoders)
    except BaseException as exc:  # noqa: BLE001 - the front reports it
        conn_out.send(("start_failed", f"{type(exc).__name__}: {exc}"))
        return
    conn_out.send(("ready", os.getpid(), fingerprint))
    _serve(conn_in, conn_out, encoders)


def _warm_up(encoders: Any) -> None:
    """One clip through both encoders before "ready", so the first voice does not pay the
    device's first-call costs (kernel loading, allocator growth)."""
    from qtts.model.voice_encoders import VoiceClip

    t = np.arange(24000, dtype=np.float32) / 24000
    result = encoders.compute_many(
        [VoiceClip((0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), "warm", False)]
    )
    if isinstance(result[0], BaseException):
        raise result[0]


def _serve(conn_in: Any, conn_out: Any, encoders: Any) -> None:
    from qtts.model.voice_encoders import VoiceClip
    from qtts.serving.device_failure import is_fatal_device_error

    while True:
        try:
            message = conn_in.recv()
        except (EOFError, OSError):
            return  # the front went away
        if message[0] != "compute":
            return
        clips = [VoiceClip(pcm, ref_text, x_vector_only) for pcm, ref_text, x_vector_only in message[1]]
        try:
            results = encoders.compute_many(clips)
        except BaseException as exc:  # noqa: BLE001 - compute_many answers per clip; this is the rest
            results = [exc] * len(clips)
        conn_out.send(("done", [_to_wire(r) for r in results]))
        if any(isinstance(r, BaseException) and is_fatal_device_error(r) for r in results):
            log.critical("voice worker: unrecoverable device error; ending for a fresh process")
            return


def _to_wire(result: Any) -> tuple:
    if isinstance(result, BaseException):
        kind = "invalid" if isinstance(result, ValueError | InvalidArgument) else "failed"
        message = getattr(result, "message", None) or str(result)
        return ("error", kind, message if kind == "invalid" else f"{type(result).__name__}: {message}")
    codes = None if result.ref_codes is None else result.ref_codes.numpy().astype(np.int16)
    return ("ok", result.x_vector.numpy().astype(np.float32), codes)


def _from_wire(item: tuple, ref_text: str | None, x_vector_only: bool) -> Any:
    if item[0] == "error":
        _, kind, message = item
        if kind == "invalid":
            return InvalidArgument(f"cannot compute the voice prompt: {message}")
        return Unavailable(f"the voice prompt could not be computed: {message}")
    import torch

    from qtts.model.prompt import VoicePrompt

    _, x_vector, codes = item
    return VoicePrompt(
        x_vector=torch.from_numpy(x_vector),
        ref_codes=None if codes is None else torch.from_numpy(codes.astype(np.int64)),
        ref_text=None if x_vector_only else ref_text,
        x_vector_only=x_vector_only,
    )


class WorkerLost(Exception):
    """The worker process ended (or could not start) before it answered."""


class VoiceWorker:
    """The front's handle on the worker process: start, compute batches (from one thread), stop.

    `compute_many` never raises for one clip's sake: every clip gets its prompt or its error
    (InvalidArgument for a bad clip, Unavailable when the worker failed or could not start)."""

    def __init__(self, spec: VoiceWorkerSpec):
        self.spec = spec
        self.fingerprint: str | None = None
        self.pid: int | None = None
        self.starts = 0  # processes started (a restart after a death counts)
        self._ctx = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._to_worker: Any = None
        self._from_worker: Any = None
        self._send_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._failed_start_at = -float("inf")
        self._failed_start = ""
        self._stopped = False

    def launch(self) -> None:
        """Spawn the process (loading begins); `start` waits for it."""
        with self._start_lock:
            if self._stopped:
                raise Unavailable("the voice prompt worker is stopped")
            if self._process is None:
                self._spawn()

    def _spawn(self) -> None:
        recv_in, send_in = self._ctx.Pipe(duplex=False)
        recv_out, send_out = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=worker_main, args=(recv_in, send_out, self.spec), name="qtts-voice-worker", daemon=True
        )
        process.start()
        recv_in.close()  # the child's ends: its death closes the pipes for us
        send_out.close()
        self._process, self._to_worker, self._from_worker = process, send_in, recv_out
        self.starts += 1

    def start(self) -> str:
        """Spawn (unless `launch` did) and wait until the encoders are loaded; their fingerprint.
        Raises WorkerLost when the process cannot start."""
        with self._start_lock:
            if self._stopped:
                raise Unavailable("the voice prompt worker is stopped")
            if self._process is not None and self.fingerprint is not None and self._process.is_alive():
                return self.fingerprint
            if self._process is not None and not self._process.is_alive():
                self._discard()
            if self._process is None:
                self._spawn()
            try:
                return self._wait_ready()
            except WorkerLost as exc:
                self._failed_start_at, self._failed_start = time.monotonic(), str(exc)
                self._discard()
                raise

    def _wait_ready(self) -> str:
        if not self._from_worker.poll(self.spec.start_timeout_s):
            raise WorkerLost(f"the voice prompt worker did not start within {self.spec.start_timeout_s:g} s")
        try:
            message = self._from_worker.recv()
        except (EOFError, OSError):
            raise WorkerLost(f"the voice prompt worker ended while starting ({self._exit_code()})") from None
        if message[0] != "ready":
            raise WorkerLost(f"the voice prompt worker could not start: {message[1]}")
        _, self.pid, self.fingerprint = message
        log.info("voice prompt worker %d ready (%s on %s)", self.pid, self.spec.model_path, self.spec.device)
        return self.fingerprint

    def compute_many(self, clips: list[Any]) -> list[Any]:
        """Each clip's `VoicePrompt` or its error; a worker that dies mid-batch is replaced and
        the batch's clips computed again one by one (a clip that kills it fails alone)."""
        try:
            return self._round_trip(clips)
        except WorkerLost as exc:
            if self._stopped:
                return [Unavailable(f"the voice prompt could not be computed: {exc}")] * len(clips)
            log.warning("voice prompt worker lost with %d clips: computing them one by one", len(clips))
        out = []
        for clip in clips:
            try:
                out.extend(self._round_trip([clip]))
            except WorkerLost as exc:
                out.append(Unavailable(f"the voice prompt could not be computed: {exc}"))
        return out

    def _round_trip(self, clips: list[Any]) -> list[Any]:
        self._ensure_running()
        payload = [
            (np.ascontiguousarray(c.pcm, dtype=np.float32), c.ref_text, c.x_vector_only) for c in clips
        ]
        try:
            with self._send_lock:
                self._to_worker.send(("compute", payload))
            reply = self._from_worker.recv()
        except (EOFError, OSError):
            ended = self._exit_code()
            with self._start_lock:
                self._discard()  # the next batch starts a fresh process
            raise WorkerLost(f"the voice prompt worker ended ({ended})") from None
        return [
            _from_wire(item, c.ref_text, c.x_vector_only) for item, c in zip(reply[1], clips, strict=True)
        ]

    def _ensure_running(self) -> None:
        if self._stopped:
            raise WorkerLost("the voice prompt worker is stopped")
        if self._process is not None and self._process.is_alive() and self.fingerprint is not None:
            return
        since = time.monotonic() - self._failed_start_at
        if since < RESTART_BACKOFF_S:
            raise WorkerLost(f"{self._failed_start} (retrying in {RESTART_BACKOFF_S - since:.0f} s)")
        if self.fingerprint is not None:
            log.warning("voice prompt worker %s ended: starting a new one", self.pid)
        fingerprint = self.fingerprint
        self.start()
        if fingerprint is not None and self.fingerprint != fingerprint:
            self._stopped = True  # prompts are keyed by the first one's weights
            raise WorkerLost("the restarted voice prompt worker loaded different encoder weights")

    def _exit_code(self) -> str:
        process = self._process
        if process is None:
            return "not started"
        process.join(timeout=1.0)
        return f"exit code {process.exitcode}"

    def _discard(self) -> None:
        for conn in (self._to_worker, self._from_worker):
            if conn is not None:
                conn.close()
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5.0)
        self._process = self._to_worker = self._from_worker = None

    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the process to end, then make sure it has (terminate, kill)."""
        self._stopped = True
        process = self._process
        if process is None:
            return
        try:
            with self._send_lock:
                self._to_worker.send(("stop",))
        except (OSError, ValueError, AttributeError):
            pass  # gone already
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.terminate()
            process.join(timeout=2.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=2.0)
        for conn in (self._to_worker, self._from_worker):
            if conn is not None:
                conn.close()
