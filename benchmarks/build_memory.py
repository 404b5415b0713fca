"""Peak RSS per rank while building a model on 2 gloo ranks under FSDP2 (ZeRO-3), the meta path
(build on meta, shard, materialise only the local shard) against the old one (every rank
materialised the whole fp32 model, then sharded it). Each path runs in its own launch, so each
peak is its own. A model of ~0.6B parameters makes the weights dominate torch's own ~300 MB.

    python benchmarks/build_memory.py [--layers 12] [--dim 1536]
"""

import argparse
import json
import tempfile
from pathlib import Path

from cpu import cpu_label
from launch_workers import torchrun_workers

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1536)
    args = parser.parse_args()
    overrides = [
        "parallel.dp_shard=2",
        "parallel.zero_stage=3",
        f"model.num_layers={args.layers}",
        f"model.dim={args.dim}",
        f"model.inter_dim={4 * args.dim}",
        f"model.moe_inter_dim={args.dim // 2}",
        "model.num_routed_experts=16",
        "model.vocab_size=32000",
    ]
    print(f"CPU: {cpu_label()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results = {}
        for mode in ("old", "new"):
            torchrun_workers(
                2, HERE / "build_memory_worker.py", str(out), mode, json.dumps(overrides)
            )
            results[mode] = [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in (0, 1)]
    params = sum(r["local_params"] for r in results["new"])
    gib = 4 * params / 2**30
    print(f"model: {params / 1e9:.2f}B parameters ({gib:.2f} GiB in fp32), dp_shard 2, ZeRO-3")
    print(
        f"{'path':6} {'rank':>4} {'RSS before MB':>14} {'peak RSS MB':>12} "
        f"{'peak - before':>14} {'build s':>8}"
    )
    for mode in ("old", "new"):
        for rank, r in enumerate(results[mode]):
            grown = r["peak_mb"] - r["before_mb"]
            print(
                f"{mode:6} {rank:>4} {r['before_mb']:>14.0f} {r['peak_mb']:>12.0f} "
                f"{grown:>14.0f} {r['seconds']:>8.1f}"
            )
    for rank in (0, 1):
        old, new = results["old"][rank], results["new"][rank]
        grown = (new["peak_mb"] - new["before_mb"]) / (old["peak_mb"] - old["before_mb"])
        print(
            f"rank {rank}: new / old peak RSS {new['peak_mb'] / old['peak_mb']:.2f}; growth during "
            f"the build {grown:.2f}"
        )


if __name__ == "__main__":
    main()
