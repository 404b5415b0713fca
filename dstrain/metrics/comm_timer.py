"""Exposed communication: the time ranks spend blocked in collectives that compute did not hide.

Why our own: PyTorch has no per-step communication timing. The profiler sees collectives but costs
far more than the 2% a metric may take, and NCCL's completion hooks exist only for NCCL and time
the kernels, not whether compute waited for them. So this module times the points where the
training thread blocks on a collective, on every path our layouts use:

- `torch.distributed` collectives (FSDP2's all-gathers and reduce-scatters,
  our loss, norm and load all-reduces, expert-gradient reductions): a blocking call is timed
  whole; an `async_op=True` call is timed where its `Work.wait()` blocks.
- functional collectives (DTensor tensor/sequence parallelism, expert-parallel all-to-alls): timed
  at `wait_tensor`, where their results are first needed.
- DDP's bucketed all-reduce runs inside the C++ reducer, overlapped with backward: what is exposed
  is the tail between the last gradient computed and backward returning, timed with gradient
  hooks (`watch_ddp`).

The spans run on the device clock (`Spans`): host time on CPUs, CUDA events on the compute stream
on GPUs, where a span measures how long the stream stalled on the collective.

Pipeline sends and receives are not counted here: a stage waiting on its neighbour is mostly
waiting on the neighbour's compute, which is the bubble (`pipeline/p2p_wait_fraction`). Their bytes
are counted under `pp`. Barriers are not counted either: they are our measurement's own.

Each collective is filed under the mesh axis of its process group (`dp`, `tp`, `ep`, `pp`, `cp`,
`world`). A functional-collective wait whose result upstream re-wrapped out of sight (some of
DTensor's) goes to the axis of the last functional collective issued: exact with one model-parallel
axis, a guess between tp and ep when both run. `other` holds waits with no known group.
"""

import functools
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.pipelining.schedules as schedules

from dstrain.metrics.spans import Spans

AXES = ("dp", "tp", "ep", "pp", "cp", "world", "other")

# Timed in `torch.distributed`. (Not isend/irecv: `P2POp` checks them by identity.)
_DIST_OPS = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "reduce",
)
_FUNCOL_OPS = (
    "all_reduce",
    "all_gather_single",
    "all_gather_tensor",
    "all_gather_single_autograd",
    "all_gather_tensor_autograd",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single_autograd",
    "reduce_scatter_tensor_autograd",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
)

_active: "CommTimer | None" = None


class CommTimer:
    """Exposed seconds and bytes per mesh axis over a logging window, for this rank."""

    def __init__(self, device: torch.device, axis_of_group: dict[str, str]) -> None:
        self.spans = Spans(device)
        self.axis_of_group = axis_of_group  # process-group name -> axis
        self.bytes = dict.fromkeys(AXES, 0)
        self._async: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Work -> axis
        self._funcol: dict[int, str] = {}  # id(result tensor) -> axis, this window
        self._hint: str | None = None  # axis of the next unattributed wait (backward a2a)
        self._calling: str | None = None  # axis of the functional collective being issued
        self._last_funcol: str | None = None  # axis of the last one issued
        self._ddp_last_grad: object | None = None
        self._ddp_syncs = False
        self._ddp_bytes = 0  # gradient bytes the synchronizing DDP forwards will all-reduce

    # ---- switching on and off ----------------------------------------------------------------

    def start(self) -> None:
        """Time collectives from now on (patches `torch.distributed` once per process)."""
        global _active
        _install()
        _active = self

    def stop(self) -> None:
        """No more timing (the run is over); the patches stay, idle."""
        global _active
        if _active is self:
            _active = None

    def pause(self) -> "_Paused":
        """`with timer.pause():` collectives inside are not counted (checkpoints, metrics)."""
        return _Paused(self)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """(exposed seconds per axis, bytes per axis) since the last take; resets."""
        exposed = self.spans.take()
        moved, self.bytes = self.bytes, dict.fromkeys(AXES, 0)
        self._funcol.clear()  # results never waited on (and bases of views) would pile up
        return {axis: exposed.get(axis, 0.0) for axis in AXES}, moved

    # ---- where ranks block -------------------------------------------------------------------

    def axis(self, group: object) -> str:
        if group is None:
            group = dist.group.WORLD
        name = getattr(group, "group_name", None)
        return self.axis_of_group.get(name, "other") if name is not None else "other"

    def watch_ddp(self, ddp: torch.nn.Module, pipelined: bool = False) -> None:
        """Time DDP's exposed all-reduce: backward's tail after the last gradient, on the
        backwards that synchronize. Which ones: in our loop, those whose forward ran outside
        `no_sync`; under upstream's pipeline stages (`pipelined`), which run every forward in
        `no_sync` and only the last backward outside it, those outside `no_sync`."""
        grads = [p for p in ddp.parameters() if p.requires_grad]
        size = sum(p.numel() * p.element_size() for p in grads)

        def note_forward(module: Any, args: Any) -> None:
            self._ddp_syncs = bool(module.require_backward_grad_sync)

        def note_grad(param: torch.Tensor) -> None:
            syncs = ddp.require_backward_grad_sync if pipelined else self._ddp_syncs
            if _active is self and syncs:
                if self._ddp_last_grad is None:
                    self._ddp_bytes += size
                self._ddp_last_grad = self.spans.start()

        if not pipelined:
            ddp.register_forward_pre_hook(note_forward)
        for param in grads:
            param.register_post_accumulate_grad_hook(note_grad)

    def backward_done(self) -> None:
        """Called after each backward returns: closes the DDP tail span, if one is open."""
        if self._ddp_last_grad is not None:
            self.spans.stop("dp", self._ddp_last_grad)
            self._ddp_last_grad = None
            self.bytes["dp"] += self._ddp_bytes
            self._ddp_bytes = 0

    def _set_hint(self, axis: str, grad: torch.Tensor) -> None:
        self._hint = axis


class _Paused:
    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def __enter__(self) -> None:
        global _active
        self.was, _active = _active, None

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = self.was


def label_backward(tensor: torch.Tensor, axis: str) -> torch.Tensor:
    """Upstream's functional collectives wait inside their autograd backward with no group in
    sight; a gradient hook on their output names the axis of the wait that follows. A no-op when
    no timer runs."""
    timer = _active
    if timer is not None and tensor.requires_grad:
        tensor.register_hook(functools.partial(timer._set_hint, axis))
    return tensor


# ---- the patches -----------------------------------------------------------------------------


def _install() -> None:
    if getattr(dist, "_dstrain_comm_timed", False):
        return
    for name in _DIST_OPS:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _timed_dist(original))
    schedules._batch_p2p = _counted_p2p(schedules._batch_p2p)
    for name in _FUNCOL_OPS:
        setattr(funcol, name, _counted_funcol(getattr(funcol, name)))
    funcol.wait_tensor = _timed_wait_tensor(funcol.wait_tensor)
    dist.Work.wait = _timed_work_wait(dist.Work.wait)
    dist._dstrain_comm_timed = True


def _timed_dist(fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timer = _active
        if timer is None:
            return fn(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        axis = timer.axis(bound.get("group"))
        timer.bytes[axis] += _largest(bound.values())
        if bound.get("async_op"):
            work = fn(*args, **kwargs)
            if work is not None:
                timer._async[work] = axis
            return work
        started = timer.spans.start()
        try:
            return fn(*args, **kwargs)
        finally:
            timer.spans.stop(axis, started)

    return wrapper


def _counted_p2p(batch_p2p: Callable[..., Any]) -> Callable[..., Any]:
    """Pipeline sends (every schedule issues its p2p through `schedules._batch_p2p`): bytes only;
    their waits are the pipeline timer's."""

    @functools.wraps(batch_p2p)
    def counted(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> Any:
        timer = _active
        if timer is not None:
            sends = [op.tensor for op in p2p_ops if op.op is dist.isend]
            timer.bytes["pp"] += _largest([sends]) if sends else 0
        return batch_p2p(p2p_ops, *args, **kwargs)

    return counted


def _timed_work_wait(wait: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(wait)
    def timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        timer = _active
        axis = timer._async.pop(work, None) if timer is not None else None
        if axis is None:
            return wait(work, *args, **kwargs)
        started = timer.spans.start()
        try:
            return wait(work, *args, **kwargs)
        finally:
            timer.spans.stop(axis, started)

    return timed_wait


def _counted_funcol(fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        timer = _active
        if timer is None or timer._calling is not None:  # nested: the outer call counts
            return fn(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        name = funcol._resolve_group_name(bound["group"], bound.get("tag", ""))
        axis = timer.axis_of_group.get(name, "other")
        timer._calling = axis  # some wait before returning (a gather off dim 0)
        try:
            result = fn(*args, **kwargs)
        finally:
            timer._calling = None
        timer.bytes[axis] += _largest([bound.get("self"), result])
        raw = getattr(result, "elem", result)  # AsyncCollectiveTensor wraps the tensor
        timer._funcol[id(raw)] = axis
        timer._last_funcol = axis
        if raw._base is not None:  # views of it are waited on too
            timer._funcol[id(raw._base)] = axis
        return result

    return wrapper


def _timed_wait_tensor(wait_tensor: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    @functools.wraps(wait_tensor)
    def timed(tensor: torch.Tensor) -> torch.Tensor:
        timer = _active
        if timer is None:
            return wait_tensor(tensor)
        axis = (
            timer._funcol.get(id(tensor))
            or timer._funcol.get(id(tensor._base))  # a view of a result (chunk-cat of a gather)
            or timer._calling
            or timer._hint
            # Upstream re-wraps some results out of our sight (DTensor's autograd around its
            # redistributions): the axis of the last functional collective issued is the guess.
            or timer._last_funcol
            or "other"
        )
        timer._hint = None
        started = timer.spans.start()
        try:
            return wait_tensor(tensor)
        finally:
            timer.spans.stop(axis, started)

    return timed


def _largest(values: Iterable[Any]) -> int:
    """Bytes of an op, nccl-tests' "size": its largest buffer (a gather's output, a scatter's
    input), summed over tensor lists; P2P ops count the tensor sent."""
    best = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            best = max(best, value.numel() * value.element_size())
        elif isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
            best = max(best, sum(t.numel() * t.element_size() for t in value))
    return best


def axis_of_groups(meshes: Any, extra: dict[str, Any] | None = None) -> dict[str, str]:
    """Process-group name -> axis for a run's meshes, plus `extra` groups by axis (the pipeline's
    tied-embedding pair). Later entries win where one group serves several views (a 1-D axis
    spanning the world reuses the world's group)."""
    views = (
        ("world", ("world",)),
        ("dp", ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "efsdp", "edp")),
        ("cp", ("cp",)),
        ("pp", ("pp",)),
        ("ep", ("ep",)),
        ("tp", ("tp",)),
    )
    names: dict[str, str] = {dist.group.WORLD.group_name: "world"}
    for axis, view_names in views:
        for view in view_names:
            if view == "world":
                continue
            mesh = meshes[view]
            if mesh.size() > 1:
                names[mesh.get_group().group_name] = axis
    for axis, group in (extra or {}).items():
        if group is not None:
            names[group.group_name] = axis
    return names
