"""Train the same run under several layouts in one launch; rank 0 saves each final full model.

argv: OUT_DIR JSON, where JSON is {"common": [overrides], "layouts": {name: [overrides]}} and
optionally "stop_at": N, to stop every layout after N steps with a checkpoint (a run cut short,
its LR schedule still the whole run's), or "init_only": true, to save each layout's initial
weights without training ("save_initial": true saves them as NAME.initial.pt and trains on).
Each rank returns, per layout, its final loss and its own record of every step: whether it
skipped the update and its loss scale after it (fp16 runs must agree).
Under pipeline parallelism each rank holds some layers: the full state dicts of all ranks are
merged (the MTP copy of the tied embedding is checked against the embedding, then dropped).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dstrain.config.load import load_config
from dstrain.metrics.processor import Window
from dstrain.parallel.pipeline_overlap import COUNTS as OVERLAP
from dstrain.train.trainer import Trainer
from tests.distributed.harness import worker_main


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    # cpu_offload keeps the full state on global rank 0 only: fine without PP, where every rank
    # holds every layer; under PP each rank's part is needed.
    pipelined = trainer.pipeline is not None
    state = get_model_state_dict(
        trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=not pipelined)
    )
    if not pipelined:
        return state
    state = {k: v.detach().cpu() for k, v in state.items()}
    parts: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, state)
    merged = {k: v for part in parts for k, v in part.items()}
    copy = merged.pop("mtp_embed.weight", None)
    if copy is not None:
        assert torch.equal(copy, merged["embed.weight"]), "the tied MTP embedding drifted"
    return merged


def cut_short(trainer: Trainer, steps: int) -> float:
    """Train `steps` steps (logging each) and checkpoint, as a run interrupted there would have."""
    window = Window()
    while trainer.step < steps:
        window.start()
        result = trainer._one_step()
        window.stop(result.tokens)
        trainer._log_metrics(result, window, NO_PROGRESS)
    trainer.save_checkpoint()
    trainer.checkpoints.close()
    for sink in trainer.sinks:
        sink.close()
    return result.loss.item()


class _NoProgress:
    def report(self, step, metrics):
        pass


NO_PROGRESS = _NoProgress()


def train_all(out_dir):
    spec = json.loads(sys.argv[2])
    done = {}
    for name, overrides in spec["layouts"].items():
        config = load_config(None, [*spec["common"], f"run.name={name}", *overrides]).config
        trainer = Trainer(config)
        if spec.get("init_only"):
            state = full_weights(trainer)
            if dist.get_rank() == 0:
                torch.save(state, out_dir / f"{name}.pt")
            done[name] = 0.0
            dist.barrier()
            continue
        if spec.get("save_initial"):  # the loaded weights too, before the first step
            state = full_weights(trainer)
            if dist.get_rank() == 0:
                torch.save(state, out_dir / f"{name}.initial.pt")
        if "stop_at" in spec:
            done[name] = cut_short(trainer, spec["stop_at"])
            continue
        steps = record_steps(trainer)
        pairs, hand_overs = OVERLAP["pairs"], OVERLAP["hand_overs"]
        summary = trainer.train()
        state = full_weights(trainer)
        if dist.get_rank() == 0:
            torch.save(state, out_dir / f"{name}.pt")
        done[name] = {"loss": summary.final_loss, "steps": steps}
        done[name]["overlapped_pairs"] = OVERLAP["pairs"] - pairs
        done[name]["hand_overs"] = OVERLAP["hand_overs"] - hand_overs
        if trainer.init_from is not None:
            done[name]["init_from_read"] = trainer.init_from.bytes_read
            done[name]["init_from_total"] = trainer.init_from.total_bytes
        dist.barrier()
    return done


def record_steps(trainer: Trainer) -> list[dict]:
    """This rank's own view of every step: skipped or not, and its loss scale after it."""
    steps, one_step = [], trainer._one_step

    def recorded():
        result = one_step()
        steps.append({"skipped": result.skipped, "scale": trainer.scaler.scale})
        return result

    trainer._one_step = recorded
    return steps


if __name__ == "__main__":
    sys.exit(worker_main(train_all))
