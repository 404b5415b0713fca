"""Saving checkpoints (DCP shards + an integrity manifest, published atomically), sync or async.

Publishing `step-N`; every rank writes its own shards, rank 0 does the rest:
    1. rank 0 clears `.step-*.tmp` folders a crash left behind and creates the folder
    2. every rank writes its shards into `.step-N.tmp` (DCP: rank 0 writes `.metadata` last,
       only after gathering every rank's write results)
    3. rank 0 hashes and fsyncs every file and writes `manifest.json` (manifest.py)
    4. rank 0 renames `.step-N.tmp` -> `step-N` and fsyncs the parent folder
    5. only then `latest` moves (a rename), and older checkpoints are pruned to keep_last_k
A crash anywhere leaves the earlier checkpoints untouched and at most a tmp folder, which the next
save clears; a folder without a manifest that verifies is never resumed from (catalog.py).

Process group. The writer creates its own gloo group at its first save (a collective: every rank
saves at the same steps) and runs all its collectives there: DCP's planning and result gathering,
and the flag all-reduces below. Its own, because async DCP runs collectives on a background thread,
and on the default group those interleave with training's and deadlock (TORCH-CPU-NOTES); gloo,
because they move CPU tensors and pickled objects even when training runs on NCCL.

Failures: a save fails on every rank or on none, and a failed save publishes nothing.
  - DCP shares its own failures: it gathers every rank's exception and broadcasts the outcome,
    so a shard that any rank cannot write raises on all ranks.
  - What rank 0 does alone (folders, manifest, rename, pointer) is followed by one all-reduce of a
    failure flag (MAX over ranks), so the others raise too instead of going on or hanging.
  Rank 0 removes the tmp folder (and undoes a rename when the pointer cannot follow it). I/O
  errors (OSError, also inside DCP's CheckpointException) raise CheckpointSaveError; anything
  else is a bug and raises as itself.

Async (`async_save=True`). `dcp.async_save` stages first: in torch 2.13 it deep-copies every tensor
into fresh CPU memory before returning (state_dict_saver.async_save -> DefaultStager with
use_async_staging=False -> StateDictStager.stage allocates new storages and copies), then writes
from a background thread. So training may change the weights in place as soon as `save` returns;
the checkpoint holds the values at the call, at the price of one copy of the rank's state in host
memory while it is written. At most one save is in flight: a second `save` first waits for the
first and publishes it.
  Who publishes: DCP's coordinator (rank 0) writes `.metadata` only after every rank's write
  results have arrived, so when rank 0's future completes every shard is on disk. Rank 0 then
  publishes with no further collective, on its own background thread (hashing takes seconds per
  GB), chained to the DCP future.
  `poll()` only looks at futures and has no collective: ranks call it at different moments, and
  one rank's future may be done while another's is not. A failure it finds is kept; `wait()` and
  the next `save()` (which every rank calls at the same step) share it through the flag all-reduce
  and raise it on every rank. The next `save()` starts its own write before raising the earlier
  failure, so one failed save does not also cost the next one.
  A failure while staging (out of host memory) raises on its own rank only, as itself: treat it
  as fatal, since the other ranks' background saves then wait for that rank.
"""

import os
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dstrain.checkpoint import manifest
from dstrain.checkpoint.catalog import (
    POINTER,
    Kind,
    checkpoints,
    kind_folder,
    latest_valid,
    step_of,
)
from dstrain.errors import UserError

__all__ = [
    "CheckpointSaveError",
    "CheckpointWriter",
    "checkpoints",
    "latest",
    "latest_valid",
    "load",
    "step_of",
]

# Single-process DCP (no process group) says it assumes one process, which is what we mean; the
# filter is global because async saves warn from DCP's own thread.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

latest = latest_valid  # the first version's name, which export calls


class CheckpointSaveError(UserError):
    """A checkpoint could not be written (no space, no permission...). Nothing was published;
    the previous valid checkpoint stays the newest."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(
            message,
            fix
            or "free disk space or fix the permissions of the checkpoint folder; earlier "
            "checkpoints are untouched (`dstrain ckpt inspect RUN_DIR` lists them), and "
            "checkpoint.on_save_error chooses whether training continues",
            exit_code=1,
        )


@dataclass(frozen=True)
class _Job:
    root: Path  # runs/<name>/checkpoints
    kind: Kind
    step: int
    meta: dict[str, Any]  # what the manifest records besides the file list
    keep_last_k: int

    @property
    def final(self) -> Path:
        return kind_folder(self.root, self.kind) / f"step-{self.step}"

    @property
    def tmp(self) -> Path:
        return self.final.with_name(f".step-{self.step}.tmp")


@dataclass(frozen=True)
class _Pending:
    job: _Job
    future: Future  # rank 0: the publish (-> Path); other ranks: DCP's write


class CheckpointWriter:
    """Writes one run's checkpoints into `folder` (runs/<name>/checkpoints). Every method is
    called by every rank at the same step, except `poll`, which any rank may call at any time."""

    def __init__(self, folder: Path, *, keep_last_k: int, async_save: bool, is_main: bool) -> None:
        self.folder = folder
        self.keep_last_k = keep_last_k
        self.async_save = async_save
        self.is_main = is_main
        self._group: dist.ProcessGroup | None = None
        self._started = False  # a first save has run, so every rank holds the group
        self._pending: _Pending | None = None
        self._failure: BaseException | None = None  # an async failure not yet shared
        self._last_job: _Job | None = None
        self._publisher: ThreadPoolExecutor | None = None  # rank 0's publishing thread

    def save(
        self, step: int, state: dict[str, Any], meta: dict[str, Any], kind: Kind = "full"
    ) -> Path:
        """Save `state` as step-{step} ("full": folder/step-N; "model": folder/model/step-N) with
        `meta` in its manifest. Returns the checkpoint's path: published on return when
        synchronous, by a later `poll`/`wait`/`save` when async. Collective."""
        job = self._job(step, kind, meta)
        self._finish_pending()
        group = self._process_group()
        prepare_error = _prepare(job) if self.is_main else None
        earlier_failed, prepare_failed = _any_rank(
            (self._failure is not None, prepare_error is not None), group
        )
        earlier = self._take_failure(earlier_failed)
        if prepare_failed:
            raise _save_error(job, prepare_error)
        if self.async_save:
            self._start(job, state, group)
        else:
            _write_and_publish(job, state, group, self.is_main)
        if earlier is not None:
            raise earlier
        return job.final

    def poll(self) -> Path | None:
        """Reap a finished async save: rank 0 returns the checkpoint it published. Cheap and
        local (no collective); a failure is kept for `wait`/`save` to raise on every rank."""
        if self._pending is None or not self._pending.future.done():
            return None
        return self._reap()

    def wait(self) -> Path | None:
        """Block until the save in flight is published (rank 0 returns its path), and raise any
        async failure on every rank. Collective."""
        published = self._finish_pending()
        if self.async_save and self._started:
            (failed,) = _any_rank((self._failure is not None,), self._group)
            failure = self._take_failure(failed)
            if failure is not None:
                raise failure
        return published

    def finish_alone(self, timeout_s: float) -> None:
        """For a rank that is leaving (it ran out of memory): wait up to `timeout_s` for the save
        in flight to finish on this rank, with no collective (the other ranks may be blocked in
        one it will never join). Rank 0 publishes it once every rank's shards are written; a
        failure or the timeout leaves it unpublished, as any failed save."""
        if self._pending is None:
            return
        try:
            self._pending.future.exception(timeout=timeout_s)
        except TimeoutError:
            return
        self._reap()

    def close(self) -> None:
        """`wait`, then stop the publishing thread. Collective."""
        try:
            self.wait()
        finally:
            if self._publisher is not None:
                self._publisher.shutdown(wait=True)
                self._publisher = None

    def _job(self, step: int, kind: Kind, meta: dict[str, Any]) -> _Job:
        if kind not in ("full", "model"):
            raise ValueError(f"checkpoint kind must be `full` or `model`, got {kind!r}")
        return _Job(self.folder, kind, step, {**meta, "kind": kind, "step": step}, self.keep_last_k)

    def _process_group(self) -> dist.ProcessGroup | None:
        if not self._started:
            if dist.is_initialized():
                self._group = dist.new_group(backend="gloo")  # collective: first save, all ranks
            self._started = True
        return self._group

    def _start(self, job: _Job, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
        upload = dcp.async_save(state, checkpoint_id=str(job.tmp), process_group=group)
        if self.is_main:
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="dstrain-ckpt-publish")
            future = self._publisher.submit(_publish_when_written, upload, job)
        else:
            future = upload
        self._pending = _Pending(job, future)

    def _finish_pending(self) -> Path | None:
        if self._pending is None:
            return None
        self._pending.future.exception()  # blocks until done; _reap takes the outcome
        return self._reap()

    def _reap(self) -> Path | None:
        assert self._pending is not None
        job, future = self._pending.job, self._pending.future
        self._pending, self._last_job = None, job
        try:
            result = future.result()
        except (Exception, CheckpointException) as exc:
            self._failure = _save_error(job, exc)
            return None
        return result if self.is_main else None

    def _take_failure(self, failed_somewhere: bool) -> BaseException | None:
        """The async failure to raise on this rank once the all-reduce said one rank has one."""
        failure, self._failure = self._failure, None
        if not failed_somewhere:
            return None
        return failure or _save_error(self._last_job, None)


def load(path: Path, state: dict[str, Any], *, verify: bool = False) -> None:
    """Fill `state` (tensors in place, other values replaced) from the checkpoint at `path`.
    `verify` first checks its manifest (sha256 under 2 GiB, sizes above; manifest.verify)."""
    if verify:
        verdict = manifest.verify(path, quick=None)
        if not verdict.ok:
            raise UserError(
                f"{path} is not a valid checkpoint: {verdict.reason}",
                "resume from an earlier one (`dstrain ckpt inspect RUN_DIR` lists them)",
                exit_code=1,
            )
    if not (path / ".metadata").exists():
        raise UserError(
            f"{path} is not a dstrain checkpoint (no .metadata)",
            "pass a runs/<name>/checkpoints/step-N folder",
            exit_code=1,
        )
    dcp.load(state, checkpoint_id=str(path))


def _prepare(job: _Job) -> OSError | None:
    """Rank 0, before any rank writes: the folder exists and holds no stale tmp folders."""
    where = job.final.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        for stale in where.glob(".step-*.tmp"):
            shutil.rmtree(stale)
    except OSError as exc:
        return exc
    return None


def _write_and_publish(
    job: _Job, state: dict[str, Any], group: dist.ProcessGroup | None, is_main: bool
) -> None:
    """A synchronous save: every rank writes, rank 0 publishes, every rank learns the outcome."""
    error: BaseException | None = None
    try:
        dcp.save(state, checkpoint_id=str(job.tmp), process_group=group)
        if is_main:
            _publish(job)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        error = exc
        if is_main:
            _remove(job.tmp)
    (failed,) = _any_rank((error is not None,), group)
    if failed:
        raise _save_error(job, error)


def _publish_when_written(upload: Future, job: _Job) -> Path:
    """Rank 0's publishing thread: once DCP's write has finished on every rank, publish."""
    try:
        upload.result()
    except (Exception, CheckpointException):
        _remove(job.tmp)
        raise
    return _publish(job)


def _publish(job: _Job) -> Path:
    """Rank 0, once every shard is written: manifest, rename, pointer, prune (module docstring).
    On failure nothing stays published and the tmp folder is gone."""
    try:
        manifest.write_manifest(job.tmp, job.meta)
        if job.final.exists():  # the same step saved again by a run resumed from earlier
            shutil.rmtree(job.final)
        os.replace(job.tmp, job.final)
    except OSError:
        _remove(job.tmp)
        raise
    try:
        manifest.fsync_dir(job.final.parent)
        manifest.write_atomic(job.final.parent / POINTER, job.final.name + "\n")
    except OSError:
        _remove(job.final)  # all or nothing: no checkpoint the pointer does not follow
        raise
    _prune(job)
    return job.final


def _prune(job: _Job) -> None:
    if not job.keep_last_k:
        return
    for old in checkpoints(job.root, job.kind)[: -job.keep_last_k]:
        if old != job.final:  # newer leftovers of an abandoned run never push out the new one
            shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _any_rank(flags: tuple[bool, ...], group: dist.ProcessGroup | None) -> tuple[bool, ...]:
    """Element-wise OR of every rank's flags: one tiny all-reduce, and so a sync point."""
    if not dist.is_initialized():
        return flags
    # The writer's group is gloo (CPU); the legacy save() runs on the default group, NCCL on GPUs.
    on_cpu = "gloo" in dist.get_backend(group)
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return tuple(bool(v) for v in values.tolist())


def _save_error(job: _Job | None, exc: BaseException | None) -> BaseException:
    """What a failed save raises: CheckpointSaveError for I/O trouble, a bug as itself."""
    where = job.final if job is not None else "a checkpoint"
    if exc is None:  # this rank did its part; another one failed
        return CheckpointSaveError(
            f"checkpoint {where} was not saved: another rank failed (its error says why)"
        )
    cause = _io_cause(exc)
    if cause is None:
        return exc
    error = CheckpointSaveError(f"checkpoint {where} was not saved: {cause}")
    error.__cause__ = exc
    return error


def _io_cause(exc: BaseException) -> str | None:
    """The OSError behind `exc` (DCP wraps each rank's in a CheckpointException), described."""
    if isinstance(exc, OSError):
        return str(exc)
    if isinstance(exc, CheckpointException):
        for rank, (inner, _trace) in sorted(exc.failures.items()):
            found = _io_cause(inner)
            if found:
                return f"{found} (rank {rank})"
    if exc.__cause__ is not None:
        return _io_cause(exc.__cause__)
    return None
