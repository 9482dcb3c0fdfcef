"""The graph-vs-eager check of `benchmarks.talker_step`: greedy codes of a captured frame step
against the eager step from the same state, per batch bucket, and the PASS/FAIL verdict of
`--agreement-only`."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.talker_step_numerics import tf32_label
from qtts.engine.model_runner import DEFAULT_BATCH_BUCKETS, I_GREEDY, I_PGREEDY, ModelRunner


def bucket_map(batches: list[int]) -> dict[int, int]:
    """The batch bucket each of `batches` runs in, as ModelRunner.bucket maps it when its slots are
    max(batches) and its buckets DEFAULT_BATCH_BUCKETS (those below the slot count, and the count)."""
    slots = max(batches)
    buckets = sorted({b for b in DEFAULT_BATCH_BUCKETS if b < slots} | {slots})
    return {b: next(n for n in buckets if n >= b) for b in batches}


def graph_eager_agreement(
    runner: ModelRunner, n: int, ctx: int, rows: int | None = None, frames: int = 1
) -> dict[str, float]:
    """Greedy codes of one graph replay against one eager frame step from the same state, for
    `frames` consecutive frames of rows [0, rows) (default: the whole bucket of n rows; the caller
    marks them active). Each frame starts both paths from the same state (state, sampling
    parameters, next input, penalty mask; the KV positions they write are rewritten by the next
    path before it reads them), then continues from the graph's result. Returns the share of
    codes equal ("codes") and of row-frames whose codes are all equal ("frames"). Every slot's
    state is put back afterwards."""
    rows = n if rows is None else rows
    graph = runner.graphs[(n, ctx)]
    state = (runner.slot_ints, runner.slot_floats, runner.next_embed, runner.seen)
    same_codes = same_frames = 0
    with torch.inference_mode():
        saved = [t.clone() for t in state]
        runner.slot_ints[:, I_GREEDY] = 1
        runner.slot_ints[:, I_PGREEDY] = 1
        for _ in range(frames):
            before = [t.clone() for t in state]
            runner._frame_step(n, ctx)
            eager = runner.codes_out[:rows].clone()
            for t, s in zip(state, before, strict=True):
                t.copy_(s)
            graph.replay()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            same = runner.codes_out[:rows] == eager  # [rows, codebooks]
            same_codes += int(same.sum().item())
            same_frames += int(same.all(dim=1).sum().item())
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)
    total = frames * rows
    return {"codes": same_codes / (total * runner.num_codebooks), "frames": same_frames / total}


def graph_matches_eager(
    runner: ModelRunner, n: int, ctx: int, rows: int | None = None, frames: int = 1
) -> float:
    """Share of greedy codes equal between graph replays and eager steps (see graph_eager_agreement)."""
    return graph_eager_agreement(runner, n, ctx, rows, frames)["codes"]


def agreement_verdict(results: list[dict[str, Any]], min_agreement: float) -> dict[str, Any]:
    """PASS when every bucket of every run has at least `min_agreement` of its row-frames equal."""
    below = [
        {
            "model": r["model"],
            "variant": r["talker_attention"],
            "batch": row["batch"],
            "bucket": row["bucket"],
            "graph_eq_eager_frames": row["graph_eq_eager_frames"],
        }
        for r in results
        for row in r["rows"]
        if row["graph_eq_eager_frames"] < min_agreement
    ]
    rows = [row for r in results for row in r["rows"]]
    worst = min(rows, key=lambda row: row["graph_eq_eager_frames"]) if rows else None
    return {
        "pass": bool(rows) and not below,
        "min_agreement": min_agreement,
        "below": below,
        "worst": None
        if worst is None
        else {k: worst[k] for k in ("batch", "bucket", "graph_eq_eager_frames")},
    }


def print_agreement(results: list[dict[str, Any]], verdict: dict[str, Any]) -> None:
    print()
    print(
        "| model | variant | dtype | tf32 | kernels | batch | bucket | graph_eq_eager (codes) | frames all equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for row in r["rows"]:
            print(
                f"| {r['model']} | {r['talker_attention']} | {r['dtype']} | {tf32_label(r['tf32'])} | "
                f"{r['kernels']} | {row['batch']} | {row['bucket']} | {row['graph_eq_eager']:.4f} | "
                f"{row['graph_eq_eager_frames']:.4f} |"
            )
    frames = ", ".join(sorted({str(r["agreement_frames"]) for r in results})) or "-"
    if verdict["pass"]:
        w = verdict["worst"]
        print(
            f"PASS: every bucket has >= {verdict['min_agreement']} of its row-frames ({frames} frames per row) "
            f"with graph codes equal to eager (lowest {w['graph_eq_eager_frames']:.4f} at batch {w['batch']}, "
            f"bucket {w['bucket']})",
            flush=True,
        )
    elif not results:
        print("FAIL: no run finished", flush=True)
    else:
        worst = ", ".join(
            f"{b['model']} [{b['variant']}] batch {b['batch']} (bucket {b['bucket']}) "
            f"{b['graph_eq_eager_frames']:.4f}"
            for b in verdict["below"]
        )
        print(f"FAIL: below {verdict['min_agreement']} of row-frames equal: {worst}", flush=True)
