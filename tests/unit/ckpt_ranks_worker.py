"""Run by tests/unit/test_checkpoint_store.py on 2 gloo ranks (torchrun): async publishing while
training collectives run, and failures on one rank reaching every rank. Writes rank{r}.json."""

import errno
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from dstrain.checkpoint import manifest, store


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    folder = out / "checkpoints"
    writer = store.CheckpointWriter(folder, keep_last_k=0, async_save=True, is_main=rank == 0)
    result = {
        "async": _async_saves(writer, folder, rank),
        "rank0_publish_fails_sync": _rank0_fails(folder, rank),
        "rank0_publish_fails_async": _rank0_fails_async(writer, folder, rank),
        "rank1_write_fails": _rank1_write_fails(folder, rank),
    }
    writer.close()
    result["published"] = sorted(p.name for p in store.checkpoints(folder))
    result["leftovers"] = sorted(p.name for p in folder.glob(".step-*"))
    result["latest"] = (folder / "latest").read_text().strip()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's exit-time abort (TORCH-CPU-NOTES)


def _state(rank: int, value: float) -> dict:
    return {f"weights_rank{rank}": torch.full((256,), value), "step": 0}


def _train_until_reaped(writer: store.CheckpointWriter) -> list[str]:
    """All-reduces on the default group (training) while the save runs; every rank polls."""
    published = []
    while True:
        path = writer.poll()
        if path is not None:
            published.append(path.name)
        idle = torch.tensor([int(writer._pending is None)])
        dist.all_reduce(idle, op=dist.ReduceOp.MIN)  # a training collective, overlapping DCP's
        if idle.item():
            return published


def _async_saves(writer: store.CheckpointWriter, folder: Path, rank: int) -> dict:
    state = _state(rank, 1.0)
    writer.save(1, state, {"tokens_seen": 1})
    state[f"weights_rank{rank}"].add_(100.0)  # training moves on at once: the save staged a copy
    published = _train_until_reaped(writer)
    writer.save(2, state, {"tokens_seen": 2})
    writer.wait()
    loaded = _state(rank, 0.0)
    store.load(folder / "step-1", loaded, verify=True)
    return {
        "published_by_poll": published,
        "step1_value": loaded[f"weights_rank{rank}"][0].item(),
        "valid": [manifest.verify(folder / f"step-{s}").ok for s in (1, 2)],
    }


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _rank0_fails(folder: Path, rank: int) -> str:
    """Only rank 0 fails (its manifest write); rank 1 must learn of it and raise too."""
    writer = store.CheckpointWriter(folder, keep_last_k=0, async_save=False, is_main=rank == 0)
    original = manifest.write_manifest
    if rank == 0:
        manifest.write_manifest = _no_space
    try:
        writer.save(3, _state(rank, 3.0), {})
        return "no error"
    except store.CheckpointSaveError as exc:
        return exc.message
    finally:
        manifest.write_manifest = original
        writer.close()


def _rank0_fails_async(writer: store.CheckpointWriter, folder: Path, rank: int) -> dict:
    original = manifest.write_manifest
    if rank == 0:
        manifest.write_manifest = _no_space
    try:
        writer.save(4, _state(rank, 4.0), {})
        _train_until_reaped(writer)  # poll must not raise: ranks poll at different moments
    finally:
        manifest.write_manifest = original
    try:
        writer.wait()
        raised = "no error"
    except store.CheckpointSaveError as exc:
        raised = exc.message
    writer.save(5, _state(rank, 5.0), {})
    writer.wait()
    return {"wait_raised": raised, "step5_valid": manifest.verify(folder / "step-5").ok}


def _rank1_write_fails(folder: Path, rank: int) -> str:
    """Only rank 1 cannot write its shard: DCP shares the failure, rank 0 publishes nothing."""
    writer = store.CheckpointWriter(folder, keep_last_k=0, async_save=False, is_main=rank == 0)
    original = FileSystem.create_stream
    if rank == 1:
        FileSystem.create_stream = _no_space
    try:
        writer.save(6, _state(rank, 6.0), {})
        return "no error"
    except store.CheckpointSaveError as exc:
        return exc.message
    finally:
        FileSystem.create_stream = original
        writer.close()


if __name__ == "__main__":
    main()
