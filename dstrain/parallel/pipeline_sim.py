"""Simulating a pipeline schedule: which compute action each rank runs, in which order, and when.

`schedule_actions` gives the per-rank order that torch.distributed.pipelining executes;
`simulate` plays it with per-action costs and point-to-point latency and measures the bubble
and the activations held in flight. Nothing here touches a device or a process group.
"""

from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, NamedTuple

from dstrain.planner.bubble import Costs, stages_per_rank

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action

# Upstream's names for the schedules whose order we read from torch (see `_upstream_order`).
UPSTREAM_NAMES = {
    "interleaved-1f1b": "Interleaved1F1B",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
KINDS = ("F", "B", "I", "W")  # forward, full backward, input-gradient, weight-gradient backward


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # one of KINDS
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"  # upstream's notation, e.g. 3F1


class Block(NamedTuple):
    start: float
    end: float
    action: Action


@dataclass
class Timeline:
    """One simulated step. Bubbles use the common interval [0, makespan] on every rank, as the
    closed forms of `dstrain.planner.bubble` do."""

    blocks: list[list[Block]]  # per rank, in execution order
    stages: list[tuple[int, ...]]  # per rank, the stages it holds, ascending (chunk 0, 1, ...)
    makespan: float
    bubble_fraction: float  # 1 - busy / (p * makespan)
    rank_bubble: list[float]  # per rank: 1 - busy_r / makespan
    peak_inflight: list[int]  # per rank: most (stage, micro-batch) activations held at once

    @property
    def pp(self) -> int:
        return len(self.blocks)


class ShapeError(ValueError):
    """A (schedule, pp, micro-batches, stages per rank) that upstream refuses; `fix` says what
    would run."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message}; fix: {fix}")
        self.message = message
        self.fix = fix


def schedule_actions(
    schedule: str, pp: int, microbatches: int, virtual_stages: int = 1
) -> list[list[Action]]:
    """Per rank, the compute actions the upstream runtime executes, in order.

    `virtual_stages` only matters for interleaved-1f1b (V-shaped schedules hold 2 stages per rank,
    gpipe and 1f1b 1). Raises `ShapeError` for a shape upstream refuses, naming the fix.
    """
    v = stages_per_rank(schedule, virtual_stages)
    _check_shape(schedule, pp, microbatches, v)
    if schedule == "gpipe":
        return [_gpipe(rank, microbatches) for rank in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(rank, pp, microbatches) for rank in range(pp)]
    return _upstream_order(UPSTREAM_NAMES[schedule], pp, microbatches, v)


def _check_shape(schedule: str, pp: int, m: int, v: int) -> None:
    """Upstream's own constraints, checked first so the message can say what to change."""
    if pp < 1 or m < 1:
        raise ShapeError(f"pp={pp}, microbatches={m}", "both must be >= 1")
    if schedule == "1f1b" and m < pp:
        raise ShapeError(
            f"1f1b needs at least as many micro-batches as ranks, got {m} for pp={pp}",
            f"use >= {pp} micro-batches, or gpipe",
        )
    if schedule == "interleaved-1f1b":
        if v < 2:
            raise ShapeError(
                f"interleaved-1f1b needs >= 2 stages per rank, got {v}",
                "use virtual stages >= 2, or 1f1b",
            )
        # Upstream runs max(1, m // pp) rounds and needs whole rounds.
        if m % max(1, m // pp):
            ok = next(k for k in count(m) if k % max(1, k // pp) == 0)
            raise ShapeError(
                f"interleaved-1f1b cannot split {m} micro-batches into max(1, {m} // {pp}) = "
                f"{m // pp} equal rounds",
                f"use {ok} micro-batches (any multiple of pp={pp} works)",
            )
    if schedule == "dualpipev" and m < 2 * pp:
        raise ShapeError(
            f"dualpipev needs at least as many micro-batches as stages (2 x pp = {2 * pp}), "
            f"got {m}",
            f"use >= {2 * pp} micro-batches",
        )


def _gpipe(rank: int, m: int) -> list[Action]:
    return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    # Not upstream's `pipeline_order`: in torch 2.13 that descriptive order disagrees with the
    # runtime (its last rank lists F1..Fm: F0 missing, Fm out of range; e.g. rank 1 of pp=2,
    # m=4). This is what Schedule1F1B._step_microbatches executes: min(m, pp - stage) warm-up
    # forwards, then backward/forward pairs until every forward is issued, then the backwards.
    warmup = min(m, pp - rank)
    actions = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action(rank, "B", i), Action(rank, "F", warmup + i)]
    return actions + [Action(rank, "B", i) for i in range(m - warmup, m)]


def _upstream_order(name: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """The order torch's own schedule class computes (and its runtime executes), compute only."""
    # Imported here: torch.distributed.pipelining takes seconds to import and gpipe/1f1b never
    # need it.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        ops = get_schedule_ops(name, pp, m, v)
    except (ValueError, AssertionError) as exc:
        raise ShapeError(
            f"upstream {name} refuses pp={pp}, microbatches={m}: {exc}",
            "change the number of micro-batches or of pipeline ranks",
        ) from exc
    return [[a for op in rank if op is not None for a in _compute(op)] for rank in ops]


def _compute(op: "_Action") -> list[Action]:
    """Our actions for one upstream `_Action`: OVERLAP_F_B becomes its sub-actions in order;
    communication, resharding and REDUCE_GRAD are dropped."""
    if op.sub_actions:
        return [a for sub in op.sub_actions for a in _compute(sub)]
    kind = op.computation_type.value
    return [Action(op.stage_index, kind, op.microbatch_index)] if kind in KINDS else []


def simulate(actions: list[list[Action]], costs: Costs, p2p: float = 0.0) -> Timeline:
    """Play `actions` (per rank, in order, one at a time) with `costs` per action and `p2p`
    latency on every hop between ranks.

    F(s,i) waits for F(s-1,i); B/I(s,i) for F(s,i) and the input-gradient of (s+1,i); W(s,i) for
    I(s,i). A rank starts its next action as soon as those and its previous action are done.
    Raises ValueError if no rank can progress (a deadlocked order) or an action waits for one
    that no rank runs.
    """
    replay = _Replay(actions, costs, p2p)
    while replay.advance():
        pass
    stuck = [str(acts[len(replay.blocks[r])]) for r, acts in enumerate(actions) if replay.left(r)]
    if stuck:
        raise ValueError(f"deadlock: no rank can progress; the next action of each: {stuck}")
    return _timeline(replay.blocks, replay.rank_of)


class _Replay:
    """The state of a simulation: what each rank has run, and when each action ended."""

    def __init__(self, actions: list[list[Action]], costs: Costs, p2p: float) -> None:
        self.actions = actions
        self.rank_of = _placement(actions)
        self.last_stage = max(self.rank_of)
        self.p2p = p2p
        self.duration = {
            "F": costs.forward,
            "B": costs.full_backward,
            "I": costs.backward,
            "W": costs.weight,
        }
        self.blocks: list[list[Block]] = [[] for _ in actions]
        self.end: dict[Action, float] = {}

    def left(self, rank: int) -> bool:
        return len(self.blocks[rank]) < len(self.actions[rank])

    def advance(self) -> bool:
        """Run every rank's next actions while their inputs are ready; False if none could run.
        Start times depend only on finished actions, so the order of visiting ranks is free."""
        progressed = False
        for rank, blocks in enumerate(self.blocks):
            while self.left(rank):
                action = self.actions[rank][len(blocks)]
                ready = self._ready(action, rank)
                if ready is None:
                    break
                start = max(ready, blocks[-1].end if blocks else 0.0)
                blocks.append(Block(start, start + self.duration[action.kind], action))
                self.end[action] = blocks[-1].end
                progressed = True
        return progressed

    def _ready(self, action: Action, rank: int) -> float | None:
        """When `action`'s inputs have all arrived on `rank`; None while one is missing."""
        ready = 0.0
        for alternatives in _inputs(action, self.last_stage):
            ends = [self.end[a] for a in alternatives if a in self.end]
            if not ends:
                if alternatives[0].stage not in self.rank_of:
                    raise ValueError(
                        f"{action} waits for stage {alternatives[0].stage}, run nowhere"
                    )
                return None
            hop = self.p2p if self.rank_of[alternatives[0].stage] != rank else 0.0
            ready = max(ready, ends[0] + hop)
        return ready


def _placement(actions: list[list[Action]]) -> dict[int, int]:
    """stage -> rank, from whichever rank's list holds the stage (r and 2p-1-r for V shapes)."""
    rank_of: dict[int, int] = {}
    for rank, acts in enumerate(actions):
        for a in acts:
            if rank_of.setdefault(a.stage, rank) != rank:
                raise ValueError(f"stage {a.stage} runs on ranks {rank_of[a.stage]} and {rank}")
    if not rank_of:
        raise ValueError("no actions to simulate")
    return rank_of


def _inputs(a: Action, last_stage: int) -> list[list[Action]]:
    """What `a` waits for, one list of alternatives per input (B or I gives the input-gradient)."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [[Action(s - 1, "F", i)]] if s > 0 else []
    if a.kind == "W":
        return [[Action(s, "I", i)]]
    needs = [[Action(s, "F", i)]]
    if s < last_stage:
        needs.append([Action(s + 1, "B", i), Action(s + 1, "I", i)])
    return needs


def _timeline(blocks: list[list[Block]], rank_of: dict[int, int]) -> Timeline:
    makespan = max(b.end for rank in blocks for b in rank)
    busy = [sum(b.end - b.start for b in rank) for rank in blocks]
    stages = [
        tuple(sorted(s for s, r in rank_of.items() if r == rank)) for rank in range(len(blocks))
    ]
    return Timeline(
        blocks=blocks,
        stages=stages,
        makespan=makespan,
        bubble_fraction=1 - sum(busy) / (len(blocks) * makespan) if makespan else 0.0,
        rank_bubble=[1 - work / makespan if makespan else 0.0 for work in busy],
        peak_inflight=[_peak_inflight(rank) for rank in blocks],
    )


def _peak_inflight(blocks: list[Block]) -> int:
    """Activations are held from a forward until the backward that frees them: the full B, or
    the W of a split backward (the input-gradient pass still needs the saved tensors)."""
    held = peak = 0
    for b in blocks:
        if b.action.kind == "F":
            held += 1
            peak = max(peak, held)
        elif b.action.kind in ("B", "W"):
            held -= 1
    return peak
