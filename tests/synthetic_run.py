"""A synthetic run directory with a key for every figure of `dstrain report` (no training)."""

import json
import math
from pathlib import Path

NUM_EXPERTS = 8
# Layer 1 is balanced; layer 2 sends expert 0 three times its share and starves experts 6 and 7.
LOADS = {"layer1": [10.0] * NUM_EXPERTS, "layer2": [30.0, *[10.0] * 5, 0.0, 0.0]}
EVERY_FIGURE_SUMMARY = {
    "steps": 20,
    "final_loss": 6.1,
    "tokens_per_s": 12345.6,
    "mfu": 0.123,
    "peak_rss_mb": 900.0,
    "wall_s": 30.0,
    "pipeline_bubble_fraction": None,
    "goodput": 0.95,
    "restarts": 0,
    "preempted": False,
    "some_new_figure": 3.25,
    "nested": {"not": "a scalar"},
}


ALL_BUT_LOSS = (
    "optim/",
    "throughput/",
    "comm/",
    "pipeline/",
    "memory/",
    "time/",
    "moe/",
    "eval/",
)


def metrics_row(step: int, scale: float = 1.0) -> dict:
    """One logged line with a key for every figure of the report."""
    fade = math.exp(-step / 10)
    return {
        "step": step,
        "loss/main": scale * (6 + 2 * fade),
        "loss/mtp": scale * (6.2 + 2 * fade),
        "loss/max_over_dp": scale * (6.3 + 2 * fade),
        "optim/lr": 1e-3 * min(1.0, step / 5),
        "optim/grad_norm": 0.5 + fade,
        "throughput/tokens_per_s": scale * (9000 - 5000 * fade),
        "throughput/mfu": scale * (0.3 - 0.1 * fade),
        "comm/exposed_fraction": 0.12 + 0.05 * fade,
        "comm/exposed_fraction_max": 0.18 + 0.05 * fade,
        "comm/dp/exposed_fraction": 0.08,
        "comm/ep/exposed_fraction": 0.04 + 0.05 * fade,
        "pipeline/bubble_fraction": 0.09 + 0.02 * fade,
        "pipeline/bubble_fraction_theory": 0.08,
        "memory/rss_mb": 700 + step,
        "memory/peak_rss_mb": 720 + step,
        "memory/peak_allocated_mb": 30000.0,
        "memory/peak_reserved_mb": 34000.0,
        "time/step_s": 0.5 + fade,
        "time/data_s": 0.01,
        "time/forward_s": 0.15 + fade / 3,
        "time/backward_s": 0.3 + fade / 2,
        "time/optimizer_s": 0.04,
        **{f"moe/{layer}/tokens_per_expert": load for layer, load in LOADS.items()},
        "moe/layer2/max_over_mean": 3.0,
        "eval/loss": scale * (6.1 + 2 * fade),
        "eval/ppl": math.exp(scale * (6.1 + 2 * fade)),
    }


def write_run(
    root: Path,
    name: str = "run-a",
    steps: int = 20,
    drop: tuple[str, ...] = (),
    scale: float = 1.0,
    tail: str = "",
) -> Path:
    """runs/<name>/ with metrics.jsonl (keys starting with a `drop` prefix left out), summary.json,
    config.toml; `tail` is appended to metrics.jsonl as is."""
    run = root / name
    run.mkdir(parents=True)
    rows = [metrics_row(step, scale) for step in range(1, steps + 1)]
    rows = [{k: v for k, v in row.items() if not k.startswith(drop)} for row in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    (run / "summary.json").write_text(json.dumps(EVERY_FIGURE_SUMMARY))
    (run / "config.toml").write_text(f'[run]\nname = "{name}"\n\n[parallel]\nep = 2\n')
    return run
