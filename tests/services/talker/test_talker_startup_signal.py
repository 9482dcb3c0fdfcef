"""`python -m services.talker` stopped by SIGTERM before it is SERVING: while it loads its model or
while it warms up (each made slow on purpose), it exits 0 promptly and without a traceback."""

from __future__ import annotations

import signal
import textwrap

import pytest

from tests.signal_process import finish, signal_at, start

# The talker's own entry point, with one start-up step replaced by a 120 s blocking one.
TALKER = textwrap.dedent(
    """
    import sys, time
    import services.talker.server as server
    from services.talker.__main__ import main

    def slow_step(*args, **kwargs):
        print("SLOW STEP", file=sys.stderr, flush=True)
        time.sleep(120)

    setattr(server, sys.argv[1], slow_step)
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.parametrize("step", ["load_bundle", "warm_up"])
def test_sigterm_while_the_talker_starts_exits_0_promptly(step, tiny_snapshot):
    flags = ["--port", "0", "--metrics-port", "0", "--code2wav", "127.0.0.1:1", "--speaker-cache", ""]
    proc = start(TALKER, step, *flags, "--model", str(tiny_snapshot("base")))
    before = signal_at(proc, "SLOW STEP", signal.SIGTERM)
    if step == "warm_up":
        assert "loaded " in before  # the real tiny model loaded; warm-up is what got interrupted
    code, err, took = finish(proc, timeout_s=20.0)
    assert code == 0, before + err
    assert took < 15.0
    assert "received SIGTERM during start-up" in err and "talker stopped during start-up" in err
    assert "Traceback" not in before + err
