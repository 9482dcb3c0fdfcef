"""Japanese word splitting leaves its caller's floating-point mode alone.

nagisa's DyNet library is built with -ffast-math: loading it turns on flush-to-zero and
denormals-are-zero in the loading thread. Run in a fresh interpreter, since a process of the
suite may have loaded it already."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    from qtts.model.aligner import split_words

    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    words = split_words("東京に行きます", "Japanese")
    assert words == ["東京", "に", "行き", "ます"], words
    assert tiny * 1.0 > 0.0, "the caller's thread now flushes subnormals to zero"
    """
)


def test_splitting_japanese_leaves_subnormal_floats_to_the_caller():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_without_its_own_thread_the_import_would_flush_subnormals():
    """The hazard is real: the plain import on the main thread turns the mode on (if this ever
    stops holding, `nagisa_module`'s thread is no longer needed)."""
    plain = "import nagisa\nassert not (5e-324 * 1.0 > 0.0)\n"
    done = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
