"""benchmarks/talker_step.py and its parts (talker_step_agreement.py, talker_step_numerics.py) are
CUDA only: the command line, the bucket mapping of the agreement check, the PASS/FAIL verdict, and
the graph-vs-eager comparison itself (on the CPU, with a stand-in for the captured graph) are
checked here."""

from __future__ import annotations

import pytest
import torch

from benchmarks import talker_step, talker_step_agreement, talker_step_numerics
from qtts.engine.model_runner import (
    DEFAULT_BATCH_BUCKETS,
    I_GREEDY,
    I_PGREEDY,
    I_POS,
    ModelRunner,
    RunnerConfig,
)


def test_parses_float32_agreement_only():
    args = talker_step.parse_args(["--dtype", "float32", "--agreement-only"])
    assert args.dtype == "float32" and talker_step.DTYPES[args.dtype] is torch.float32
    assert args.agreement_only and args.min_agreement == 0.99 and args.agreement_frames == 8
    assert args.batches == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert not args.child
    defaults = talker_step.parse_args([])
    assert defaults.dtype == "bfloat16" and not defaults.agreement_only
    # The flags reach the per-run subprocesses, which leave the exit status to the parent.
    passed = talker_step._passthrough(args)
    assert passed[passed.index("--dtype") + 1] == "float32"
    assert "--agreement-only" in passed and "--child" in passed
    assert "--agreement-only" not in talker_step._passthrough(defaults)


def test_parses_all_buckets_and_rejects_bad_settings(capsys):
    args = talker_step.parse_args(
        ["--batches", "all", "--max-batch", "256", "--agreement-only", "--min-agreement", "0.995"]
    )
    assert args.batches == [b for b in DEFAULT_BATCH_BUCKETS if b <= 256] and args.min_agreement == 0.995
    for bad in (
        ["--dtype", "float16"],
        ["--agreement-frames", "0"],
        ["--position", "380", "--agreement-frames", "8"],
    ):
        with pytest.raises(SystemExit):
            talker_step.parse_args(bad)
    with pytest.raises(SystemExit) as exit_info:
        talker_step.parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--dtype" in out and "--agreement-only" in out and "--min-agreement" in out


def test_float32_turns_tf32_off_and_records_it():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        assert talker_step_numerics.tf32_label(talker_step_numerics.tf32_state()) == "on"
        state = talker_step_numerics.set_precision("float32")
        assert state["matmul_allow_tf32"] is False and state["cudnn_allow_tf32"] is False
        assert state["float32_matmul_precision"] == "highest"
        assert talker_step_numerics.tf32_label(state) == "off"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def test_bucket_map_follows_the_runner():
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    got = talker_step_agreement.bucket_map(batches)
    assert got[1] == 2 and all(got[b] == b for b in batches[1:])
    assert talker_step_agreement.bucket_map([3, 100, 600]) == {
        3: 4,
        100: 128,
        600: 600,
    }  # the slot count is a bucket


def test_verdict_needs_every_bucket_above_the_threshold():
    rows = [
        {"batch": 1, "bucket": 2, "graph_eq_eager": 1.0, "graph_eq_eager_frames": 1.0},
        {"batch": 64, "bucket": 64, "graph_eq_eager": 0.999, "graph_eq_eager_frames": 0.995},
    ]
    results = [{"model": "m", "talker_attention": "matmul/compile", "rows": rows}]
    ok = talker_step_agreement.agreement_verdict(results, 0.99)
    assert ok["pass"] and ok["worst"] == {"batch": 64, "bucket": 64, "graph_eq_eager_frames": 0.995}
    bad = talker_step_agreement.agreement_verdict(results, 0.999)
    assert not bad["pass"] and [b["batch"] for b in bad["below"]] == [64]
    assert not talker_step_agreement.agreement_verdict([], 0.99)["pass"]


class _Replay:
    """A stand-in for the captured graph: the eager step, with `flip` codes changed afterwards."""

    def __init__(self, runner, n, ctx, flip=()):
        self.runner, self.n, self.ctx, self.flip = runner, n, ctx, flip

    def replay(self):
        self.runner._frame_step(self.n, self.ctx)
        for row, codebook in self.flip:
            self.runner.codes_out[row, codebook] += 1


def _tiny_bundle(dtype=torch.float32):
    from types import SimpleNamespace

    from qtts.model.bundle import build_modules
    from qtts.model.config import ModelConfig
    from qtts.model.dummy import init_dummy_weights, materialize
    from qtts.tiny_model.snapshot import tiny_config

    cfg = ModelConfig.from_dict(tiny_config("base"))
    talker, predictor = build_modules(cfg)
    return SimpleNamespace(
        talker=init_dummy_weights(materialize(talker, "cpu", dtype), seed=0).eval(),
        code_predictor=init_dummy_weights(materialize(predictor, "cpu", dtype), seed=1).eval(),
        config=cfg,
        device=torch.device("cpu"),
        dtype=dtype,
        tokenizer_name="tiny",
    )


@pytest.fixture(scope="module")
def tiny_runner():
    runner = ModelRunner(_tiny_bundle(), RunnerConfig(max_len=32, max_batch=4, num_slots=4, max_trailing=8))
    talker_step.fill_slots(runner, 10)
    return runner


def test_agreement_compares_several_frames_of_the_active_rows(tiny_runner):
    runner = tiny_runner
    n, ctx = runner.bucket(3, 11)
    assert n == 4
    runner.active[:n] = False
    runner.active[:3] = True
    before = [t.clone() for t in (runner.slot_ints, runner.slot_floats, runner.next_embed, runner.seen)]
    runner.graphs[(n, ctx)] = _Replay(runner, n, ctx)
    assert talker_step_agreement.graph_eager_agreement(runner, n, ctx, rows=3, frames=3) == {
        "codes": 1.0,
        "frames": 1.0,
    }
    # One code of row 1 differs in every frame; row 3 is padding, outside the comparison.
    runner.graphs[(n, ctx)] = _Replay(runner, n, ctx, flip=((1, 5), (3, 0)))
    got = talker_step_agreement.graph_eager_agreement(runner, n, ctx, rows=3, frames=4)
    assert got["frames"] == pytest.approx(2 / 3)
    assert got["codes"] == pytest.approx(1 - 1 / (3 * runner.num_codebooks))
    assert talker_step_agreement.graph_matches_eager(runner, n, ctx, rows=3, frames=2) == pytest.approx(
        got["codes"]
    )
    # Every slot's state (sampling mode and position included) is back as it was.
    after = (runner.slot_ints, runner.slot_floats, runner.next_embed, runner.seen)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert int(runner.slot_ints[:, I_GREEDY].sum()) == int(runner.slot_ints[:, I_PGREEDY].sum()) == 0
    assert bool((runner.slot_ints[:, I_POS] == 10).all())


@pytest.mark.parametrize("broken", [False, True])
def test_agreement_only_run_end_to_end_on_the_cpu(tmp_path, monkeypatch, capsys, broken):
    """main() with --agreement-only --dtype float32 on the tiny model: the CUDA calls are stubbed and
    each captured graph is the eager step itself, so every bucket agrees and the run passes
    (`broken`: bucket 3's graph changes one code of row 0, and the run fails with exit status 1)."""
    import contextlib
    import json

    dtypes = []

    def load(name, device, dtype, load_format):
        dtypes.append(dtype)
        return _tiny_bundle(dtype)

    def capture(runner):
        runner.graphs = {
            (n, c): _Replay(runner, n, c, flip=((0, 3),) if broken and n == 3 else ())
            for n in runner.batch_buckets
            for c in runner.context_buckets
        }

    monkeypatch.setattr(talker_step, "load_talker_bundle", load)
    monkeypatch.setattr(ModelRunner, "capture_graphs", capture)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu (test)")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    out = tmp_path / "agree.json"
    try:
        with pytest.raises(SystemExit) if broken else contextlib.nullcontext() as exit_info:
            talker_step.main(
                [
                    "--models",
                    "tiny",
                    "--variants",
                    "matmul/fast",
                    "--dtype",
                    "float32",
                    "--agreement-only",
                    "--batches",
                    "1,2,3",
                    "--position",
                    "10",
                    "--context-bucket",
                    "32",
                    "--agreement-frames",
                    "2",
                    "--out",
                    str(out),
                ]
            )
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])
    assert dtypes == [torch.float32]
    data = json.loads(out.read_text())
    assert data["meta"]["dtype"] == "float32" and data["meta"]["mode"] == "agreement-only"
    assert (
        data["meta"]["tf32"]["matmul_allow_tf32"] is False
        and data["meta"]["tf32"]["cudnn_allow_tf32"] is False
    )
    assert data["agreement"]["pass"] is not broken and data["engine"] == []
    (res,) = data["results"]
    assert res["dtype"] == "float32" and res["tf32"]["float32_matmul_precision"] == "highest"
    assert not res["fused_decode"] and not res["sample_kernel"]  # CPU: the torch ops
    assert [(r["batch"], r["bucket"]) for r in res["rows"]] == [(1, 2), (2, 2), (3, 3)]
    assert all(r["graph_eq_eager"] == r["graph_eq_eager_frames"] == 1.0 for r in res["rows"][:2])
    assert res["num_graphs"] == 2  # only the buckets --batches lands in
    printed = capsys.readouterr().out
    assert "| tiny | matmul/fast | float32 | off |" in printed
    if broken:
        assert exit_info.value.code == 1 and "FAIL" in printed
        assert res["rows"][2]["graph_eq_eager_frames"] == pytest.approx(2 / 3)
        assert [b["batch"] for b in data["agreement"]["below"]] == [3]
    else:
        assert "PASS" in printed and res["rows"][2]["graph_eq_eager_frames"] == 1.0
