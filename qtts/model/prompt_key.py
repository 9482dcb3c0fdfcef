"""The prompt prefix key's hasher, and hashing that keeps the GIL (the prompt thread builds
beside the busy engine thread: every release costs it up to a switch interval)."""

from __future__ import annotations

import hashlib

import torch

PREFIX_KEY_VERSION = b"qtts-prompt-prefix-v1"


# hashlib releases the GIL for an update of this many bytes or more; the prompt thread then waits
# up to a switch interval to take it back beside the busy engine thread, for a few microseconds
# of hashing. Smaller slices hash the same bytes without letting go.
_HASHLIB_GIL_MINSIZE = 2048


def update_holding_gil(h, data: bytes) -> None:
    """`h.update(data)` in slices too small for hashlib to release the GIL (the same digest)."""
    view = memoryview(data)
    for start in range(0, len(view), _HASHLIB_GIL_MINSIZE - 1):
        h.update(view[start : start + _HASHLIB_GIL_MINSIZE - 1])


def host_bytes(t) -> bytes:
    """The bytes of a host tensor or array (C order), without a device call where it can."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu" or t.requires_grad:
            t = t.detach().cpu()
        return t.numpy().tobytes()
    return t.tobytes()


class PrefixHasher:
    """sha256 over labelled fields, so that different field splits never collide."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(PREFIX_KEY_VERSION)

    @staticmethod
    def tensor_raw(data: torch.Tensor) -> bytes:
        """The bytes a tensor field adds (kept per voice, so a build makes no device call for it)."""
        return (
            f"{data.dtype}{tuple(data.shape)}".encode() + data.detach().cpu().contiguous().numpy().tobytes()
        )

    def add_raw(self, label: str, raw: bytes) -> None:
        update_holding_gil(self._h, label.encode() + b"\0" + len(raw).to_bytes(8, "little") + raw)

    def add(self, label: str, data: bytes | str | int | list[int] | None) -> None:
        """A field; a tensor's goes in as `add_raw(label, tensor_raw(t))`, made once per voice."""
        if data is None:
            raw = b"<none>"
        elif isinstance(data, bytes):
            raw = data
        elif isinstance(data, list):
            raw = b",".join(str(int(i)).encode() for i in data)
        else:
            raw = str(data).encode()
        self.add_raw(label, raw)

    def hexdigest(self) -> str:
        return self._h.hexdigest()
