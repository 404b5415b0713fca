"""Train the same run under several layouts in one launch; rank 0 saves each final full model.

argv: OUT_DIR JSON, where JSON is {"common": [overrides], "layouts": {name: [overrides]}}.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dstrain.config.load import load_config
from dstrain.train.trainer import Trainer
from tests.distributed.harness import worker_main


def train_all(out_dir):
    spec = json.loads(sys.argv[2])
    done = {}
    for name, overrides in spec["layouts"].items():
        config = load_config(None, [*spec["common"], f"run.name={name}", *overrides]).config
        trainer = Trainer(config)
        summary = trainer.train()
        state = get_model_state_dict(
            trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.get_rank() == 0:
            torch.save(state, out_dir / f"{name}.pt")
        done[name] = summary.final_loss
        dist.barrier()
    return done


if __name__ == "__main__":
    sys.exit(worker_main(train_all))
