"""DeepSeek-V3's published layout (PP16 DualPipeV x EP64 x ZeRO-1 on 2048 H800) dry-run per rank:
`dstrain train examples/deepseek-v3-h800x2048.toml --dry-run --world-size 2048 --rank R --json`,
each rank in its own process (import and start-up included in its time), beside what
`dstrain plan` predicts for the same pipeline rank: its model states, and its activations.

    python benchmarks/dry_run_scale.py [--ranks 0 2047] [--config PATH]
    python benchmarks/dry_run_scale.py --config examples/deepseek-v3-128k-h800x2048.toml
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from cpu import cpu_label

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 2**30


def planned(config_path: Path, world: int, pp_rank: int) -> tuple[float, float]:
    """(model states, activations) the planner predicts for pipeline rank `pp_rank`."""
    from dstrain.config.flavors import resolve_model_args
    from dstrain.config.load import load_config
    from dstrain.planner.layout import layout_from_config
    from dstrain.planner.memory import _rank_memory
    from dstrain.planner.shape import rank_shapes

    config = load_config(config_path).config
    args = resolve_model_args(config.model)
    layout = layout_from_config(config, world)
    shape = next(s for s in rank_shapes(args, layout) if s.rank == pp_rank)
    memory = _rank_memory(args, layout, shape)
    return memory.model_states, memory.activations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 2047])
    parser.add_argument("--config", type=Path, default=REPO / "examples/deepseek-v3-h800x2048.toml")
    parser.add_argument("--world-size", type=int, default=2048)
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    head = (
        f"{'rank':>5} {'pp':>3} {'stages (layers)':22} {'params GiB':>10} {'grads':>7} "
        f"{'optim':>7} {'states':>7} {'plan':>7} {'diff':>6} {'build peak':>10} "
        f"{'act peak':>9} {'plan act':>9} {'wall s':>7} {'in-process s':>12}"
    )
    print(head)
    for rank in args.ranks:
        command = [
            sys.executable, "-m", "dstrain", "train", str(args.config), "--dry-run",
            "--world-size", str(args.world_size), "--rank", str(rank), "--json",
        ]  # fmt: skip
        began = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - began
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        r = json.loads(done.stdout)
        plan, plan_act = planned(args.config, args.world_size, r["coords"]["pp"])
        stages = " ".join(f"{s['stage']}({len(s['layers'])})" for s in r["stages"])
        parts = [
            sum(r[k].values()) / GiB for k in ("params_bytes", "grads_bytes", "optimizer_bytes")
        ]
        act = r["activation_peak_bytes"]
        print(
            f"{rank:>5} {r['coords']['pp']:>3} {stages:22} {parts[0]:>10.2f} {parts[1]:>7.2f} "
            f"{parts[2]:>7.2f} {r['model_states_bytes'] / GiB:>7.2f} {plan / GiB:>7.2f} "
            f"{100 * (r['model_states_bytes'] / plan - 1):>+5.1f}% "
            f"{r['build_peak_bytes'] / GiB:>10.2f} {(act or 0) / GiB:>9.1f} "
            f"{plan_act / GiB:>9.1f} {wall:>7.1f} "
            f"{r['seconds']['total']:>12.1f}"
        )
    full = r["full_model_bytes"] / GiB
    print(f"(the old path built the whole fp32 model on every rank: {full:,.0f} GiB)")


if __name__ == "__main__":
    main()
