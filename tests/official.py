"""Import the official `qwen-tts` package (test-only reference implementation).

Its `torchaudio` dependency cannot load next to the CPU torch used here, and the 12 Hz code path
never calls it, so empty stand-in modules are registered before the import.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types


def _stub(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = mod
    return mod


def import_qwen_tts():
    """Return the `qwen_tts` module, importing it with torchaudio stubbed out if needed."""
    if "qwen_tts" in sys.modules:
        return sys.modules["qwen_tts"]
    try:
        import torchaudio  # noqa: F401
    except Exception:
        ta = _stub("torchaudio")
        comp = _stub("torchaudio.compliance")
        kaldi = _stub("torchaudio.compliance.kaldi")
        ta.compliance = comp
        comp.kaldi = kaldi
    import qwen_tts

    return qwen_tts
