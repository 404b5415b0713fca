"""DualPipeV's overlapped forward and backward (`parallel.pp_overlap`): the `OVERLAP_F_B` action.

Why our own: upstream's `ScheduleDualPipeV` emits `OVERLAP_F_B` actions (one micro-batch's forward
chunk paired with another's full backward chunk), but unless a function is registered for them
the runtime runs the two one after the other. DeepSeek's DualPipe asks the model for an
`overlapped_forward_backward` that interleaves the two chunks' phases; we get the same
interleaving without changing the model, from where the communication already is.

How. The backward chunk runs on a helper thread, the forward chunk on the schedule's thread, and
the two take turns (`Turns`): only one runs at a time, and the one running hands over at every
wait on a functional collective, which is after that collective was issued and before its result
is needed. So each MoE layer's phases alternate between the chunks: the forward's attention runs,
its dispatch all-to-all is issued, and while it is in flight the backward computes up to its own
next collective (the combine's gradient all-to-all, issued the same way inside upstream's
autograd), hands back, and so on: attention, dispatch, experts, combine of one chunk under the
other's communication. On GPU the hand-over costs no device time: a wait only makes the compute
stream wait for NCCL's, and the other chunk's kernels are queued in between; on CPU gloo runs the
collective on its own thread while the other chunk computes.

Why it is deterministic: collectives on a process group must be issued in the same order on every
rank of it. Only the side holding the turn runs (and issues anything), and the turn changes only at
the waits, whose sequence is fixed by the program, not by timing; the ranks of an ep, tp or dp
group run the same `OVERLAP_F_B` actions (same pipeline rank, same schedule), so they interleave
alike. Pipeline sends and receives stay outside: the receives both chunks need are waited for
before the pair starts, and the schedule posts the sends after it.

What is exact: the two chunks touch different micro-batches and stages, so the arithmetic is the
sequential one; the pair matches the sequential sub-actions bit for bit (tested to 1e-6).

Activation checkpointing composes: a recomputed forward inside the backward chunk waits on its
collectives like any other code of that chunk, and upstream's checkpoint re-enters the saved
autocast state itself. (torchtitan's thread-and-barrier version did not compose with selective
checkpointing because its barriers were placed in the model's forward; here nothing is.)

Private upstream API used (torch 2.13): the runtime's `fwd_recv_ops`, `bwd_recv_ops`,
`backward_counter`, `_maybe_compute_loss`, `_maybe_get_loss`, `_assert_unsharded`, `_stages`,
`_n_microbatches`, and `schedules._wait_batch_p2p`: what the sequential path does per
sub-action, redone here because the runtime's `_perform_action` is a closure.
"""

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.distributed.pipelining.schedules as schedules
from torch.distributed.pipelining.schedules import OVERLAP_F_B

from dstrain.metrics.pipeline_timer import TURN_WAITS

FORWARD, BACKWARD = "forward", "backward"
_OTHER = {FORWARD: BACKWARD, BACKWARD: FORWARD}
_turns: "Turns | None" = None  # the pair in flight (one pipeline per process)
COUNTS = {"pairs": 0, "hand_overs": 0}  # since the process started (tests, benchmarks)


class Turns:
    """Two sides of one overlapped pair take turns on the host. The forward side is the thread
    that created it and holds the first turn; any other thread is the backward side (on CUDA
    autograd runs the backward on its device thread, not the one that called it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder = FORWARD
        self._done: set[str] = set()
        self._forward_thread = threading.get_ident()
        self.hand_overs = 0

    def side(self) -> str:
        return FORWARD if threading.get_ident() == self._forward_thread else BACKWARD

    def begin(self, side: str) -> None:
        with self._cond:
            self._wait_for_turn(side)

    def hand_over(self, side: str) -> None:
        """Give the turn to the other side (unless it is done) and wait to get it back."""
        with self._cond:
            if _OTHER[side] in self._done:
                return
            self._holder = _OTHER[side]
            self.hand_overs += 1
            self._cond.notify_all()
            self._wait_for_turn(side)

    def _wait_for_turn(self, side: str) -> None:
        started = time.perf_counter()
        self._cond.wait_for(lambda: self._holder == side)
        TURN_WAITS[side] += time.perf_counter() - started  # the pipeline timer leaves it out

    def end(self, side: str) -> None:
        with self._cond:
            self._done.add(side)
            self._holder = _OTHER[side]
            self._cond.notify_all()


def register_overlap(schedule: schedules._PipelineScheduleRuntime, device: torch.device) -> None:
    """Run `schedule`'s OVERLAP_F_B actions overlapped (a no-op for schedules without them)."""
    schedule.register_custom_function(OVERLAP_F_B, _overlap_function(device))


def overlap_pairs(setting: bool | None, device: torch.device | None) -> bool:
    """`parallel.pp_overlap`: true / false as set; unset (auto) overlaps on CUDA, where NCCL
    runs the collectives on a stream of their own, and not on CPU, where gloo's threads share
    the cores the ranks compute on and `benchmarks/dualpipe_overlap.py` measured no gain (step
    time 1.03x with overlap, exposed EP 0.86x: 4 ranks on 2 cores have no idle core)."""
    if setting is not None:
        return setting
    return device is not None and device.type == "cuda"


def has_overlap_actions(schedule: object) -> bool:
    """Whether the schedule's order holds any OVERLAP_F_B action (DualPipeV's steady state)."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(
        a is not None and a.computation_type == OVERLAP_F_B
        for actions in order.values()
        for a in actions
    )


def _overlap_function(device: torch.device) -> Callable:
    def overlap_f_b(action: schedules._Action, ctx: schedules._PipelineContext) -> None:
        run_pair(ctx, *action.sub_actions, device=device)

    return overlap_f_b


def run_pair(
    ctx: schedules._PipelineContext,
    forward: schedules._Action,
    backward: schedules._Action,
    *,
    device: torch.device,
) -> None:
    """The forward sub-action on this thread and the backward one on a helper, taking turns."""
    global _turns
    schedule = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in schedule._stages}
    _install()
    _receive_forward_input(schedule, stages, forward)
    _receive_backward_input(schedule, stages, backward)
    turns = Turns()
    errors: list[BaseException] = []

    def backward_side() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # per thread
            turns.begin(BACKWARD)
            _full_backward(schedule, stages, backward)
        except BaseException as exc:  # re-raised on the schedule's thread
            errors.append(exc)
        finally:
            turns.end(BACKWARD)

    helper = threading.Thread(target=backward_side, name="dstrain-dualpipe-backward", daemon=True)
    _turns = turns
    helper.start()
    try:
        _forward(schedule, stages, forward, ctx)
    finally:
        turns.end(FORWARD)
        helper.join()
        _turns = None
        COUNTS["pairs"] += 1
        COUNTS["hand_overs"] += turns.hand_overs
    if errors:
        raise errors[0]


def _receive_forward_input(schedule, stages: dict, action: schedules._Action) -> None:
    idx, mb = action.stage_index, action.microbatch_index
    stage = stages[idx]
    schedule._assert_unsharded(stage)
    # A V schedule hands a stage its input locally when the previous stage is on this rank.
    if not stage.is_first and idx - 1 not in stages:
        schedules._wait_batch_p2p(schedule.fwd_recv_ops.pop((idx, mb)))


def _receive_backward_input(schedule, stages: dict, action: schedules._Action) -> None:
    idx, mb = action.stage_index, action.microbatch_index
    stage = stages[idx]
    schedule._assert_unsharded(stage)
    if not stage.is_last and idx + 1 not in stages:
        schedules._wait_batch_p2p(schedule.bwd_recv_ops.pop((idx, mb)))


def _forward(schedule, stages: dict, action: schedules._Action, ctx) -> None:
    idx, mb = action.stage_index, action.microbatch_index
    stage = stages[idx]
    # save_forward_output=False: dstrain steps with return_outputs=False (the loss is kept).
    output = stage.forward_one_chunk(
        mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False
    )
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
    if idx + 1 in stages:
        stages[idx + 1].set_local_fwd_input(output, mb)


def _full_backward(schedule, stages: dict, action: schedules._Action) -> None:
    idx, mb = action.stage_index, action.microbatch_index
    stage = stages[idx]
    loss = schedule._maybe_get_loss(stage, mb)
    schedule.backward_counter[idx] += 1
    last = schedule.backward_counter[idx] == schedule._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if idx - 1 in stages:
        stages[idx - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def _install() -> None:
    """Hand over at every functional-collective wait while a pair is in flight, from the
    outermost wrapper of `funcol.wait_tensor`, so that the communication timer's wrapper inside
    it times only the wait, not the other side's turn. Called before each pair: a wrapper
    installed after ours (the timer's, on its first start) gets ours around it again, and only
    the outermost of ours acts. (Upstream's waits look the name up in the module:
    `AsyncCollectiveTensor.trigger_wait` and the collectives' autograd backward.)"""
    if getattr(funcol.wait_tensor, "_dstrain_hands_over", False):
        return
    wait = funcol.wait_tensor

    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        turns = _turns
        if turns is None or getattr(_inside, "handing", False):
            return wait(tensor)
        turns.hand_over(turns.side())
        _inside.handing = True
        try:
            return wait(tensor)
        finally:
            _inside.handing = False

    wait_tensor._dstrain_hands_over = True
    funcol.wait_tensor = wait_tensor


_inside = threading.local()  # set while the outermost wrapper waits (inner ones pass through)
