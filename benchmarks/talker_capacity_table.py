"""The stdout of `benchmarks.talker_capacity`: a line per level as it finishes, the table at the end."""

from __future__ import annotations

from typing import Any


def print_level(n: int, res: dict[str, Any]) -> None:
    """One finished level of `n` streams (`res`: its `summarize` dict), flushed at once."""
    print(
        f"streams {n:5d}: step p50 {res['step_ms_p50']:.2f} ms, interval p99 {res['interval_ms_p99']:.2f} ms "
        f"(max {res['interval_ms_max']:.2f}), p99/step {res['p99_interval_over_median_step']:.2f}, "
        f"{res['arrivals_per_step']:.2f} arrivals/step, running {res['running_per_step_mean']:.0f}, "
        f"waiting {res['waiting_per_step_mean']:.0f}, prefilling {res['prefilling_per_step_mean']:.0f}, "
        f"{res['prompts_completed_per_step']:.2f} prompts completed/step "
        f"({res['prefill_positions_per_completed_prompt']:.0f} positions each), real-time {res['real_time']}",
        flush=True,
    )


def print_table(result: dict[str, Any]) -> None:
    print()
    print(
        "| streams | step p50 ms | step p99 ms | interval p50 ms | interval p99 ms | interval max ms | "
        "p99 / step | running/step | waiting/step | prefill pos/step | arrivals/step | audio s / s | real-time |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["levels"]:
        print(
            f"| {r['streams']} | {r['step_ms_p50']:.2f} | {r['step_ms_p99']:.2f} | {r['interval_ms_p50']:.2f} | "
            f"{r['interval_ms_p99']:.2f} | {r['interval_ms_max']:.2f} | {r['p99_interval_over_median_step']:.2f} | "
            f"{r['running_per_step_mean']:.0f} | {r['waiting_per_step_mean']:.0f} | "
            f"{r['prefill_positions_per_step_mean']:.0f} | {r['arrivals_per_step']:.2f} | "
            f"{r['audio_s_per_wall_s']:.1f} | {'yes' if r['real_time'] else 'no'} |"
        )
    print(
        f"\nlargest real-time level (p99 frame interval <= {result['budget_ms']} ms): {result['max_realtime_streams']}"
    )
