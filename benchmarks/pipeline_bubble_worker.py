"""The pipeline runs of `benchmarks/pipeline_bubble.py` on this rank (under torchrun).

argv: OUT_FILE SPEC, SPEC a JSON object {"common": [overrides], "runs": [[schedule, m], ...],
"micro": B, "warmup": W, "steps": N}. For each run: `Trainer(config)`, W warm-up steps, then N
timed steps through `trainer._one_step()`, and the pipeline timer's figures over those N steps
(measured bubble, mean ms per F/B/I/W action). Rank 0 writes the list as JSON.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from dstrain.config.load import load_config
from dstrain.parallel.distributed import shutdown
from dstrain.train.trainer import Trainer


def one_run(spec: dict, schedule: str, m: int) -> dict:
    v = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    overrides = [
        *spec["common"],
        f"run.name={schedule}-m{m}",
        f"parallel.pp_schedule={schedule}",
        f"parallel.num_virtual_stages={v}",
        f"train.global_batch_size={m * spec['micro']}",
    ]
    trainer = Trainer(load_config(None, overrides).config)
    for _ in range(spec["warmup"]):
        trainer._one_step()
    trainer.pipeline_timer.collect(schedule, m, v)  # drop the warm-up window
    for _ in range(spec["steps"]):
        trainer._one_step()
    return {"schedule": schedule, "m": m, "v": v, **trainer.pipeline_timer.collect(schedule, m, v)}


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rows = [one_run(spec, schedule, m) for schedule, m in spec["runs"]]
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    shutdown(0)


if __name__ == "__main__":
    main()
