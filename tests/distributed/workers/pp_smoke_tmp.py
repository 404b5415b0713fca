import sys, json
import torch.distributed as dist
from dstrain.config.load import load_config
from dstrain.train.trainer import Trainer
from tests.distributed.harness import worker_main


def run(out):
    ov = json.loads(sys.argv[2])
    cfg = load_config(None, ov).config
    t = Trainer(cfg)
    s = t.train()
    return s.final_loss


if __name__ == "__main__":
    sys.exit(worker_main(run))
