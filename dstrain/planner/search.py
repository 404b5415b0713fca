"""The search: every candidate layout (`planner/candidates.py`) gets its memory first; those that
fit get their step time; the fastest are then put to the trainer's rules (`planner/legal.py`)
until `top` legal ones are found. Then the winner is set against its neighbours (one knob
changed) to say why it wins and why each obvious alternative loses."""

from collections import Counter
from dataclasses import dataclass, field

from dstrain.config.model_args import ModelArgs
from dstrain.planner.candidates import candidates
from dstrain.planner.estimate import Constants, Estimate, add_time, estimate_memory
from dstrain.planner.layout import Cluster, Layout
from dstrain.planner.legal import trainer_errors
from dstrain.planner.memory import GiB

KNOBS = ("tp", "pp", "ep", "zero", "micro_batch", "schedule", "recompute")


@dataclass
class SearchResult:
    ranked: list[Estimate]  # legal and fitting, fastest first
    evaluated: int
    fitting: int
    refusals: Counter = field(default_factory=Counter)  # the trainer's reasons, when it refused
    alternatives: list[tuple[str, Estimate, str]] = field(default_factory=list)  # knob, est, why
    # With nothing ranked: the fastest layout that is only tight in memory (its floor fits) or
    # refused only for a limit of dstrain's own trainer (`closest`), which other engines run.
    closest: Estimate | None = None


def search(
    args: ModelArgs,
    cluster: Cluster,
    base: Layout,
    fixed: set[str],
    *,
    top: int = 10,
    consts: Constants | None = None,
) -> SearchResult:
    consts = consts or Constants()
    estimates = [
        estimate_memory(args, layout, cluster) for layout in candidates(args, cluster, base, fixed)
    ]
    fitting = [e for e in estimates if e.fits]
    for e in fitting:
        add_time(e, args, cluster, consts)
    fitting.sort(key=lambda e: e.step_time_s)
    ranked, refusals = [], Counter()
    for e in fitting:
        e.illegal = [f.message for f in trainer_errors(args, e.layout, cluster)]
        refusals.update(e.illegal[:1])
        if not e.illegal:
            ranked.append(e)
            if len(ranked) == top:
                break
    result = SearchResult(ranked, len(estimates), len(fitting), refusals)
    if ranked:
        result.alternatives = alternatives(args, cluster, ranked[0], estimates, consts)
    else:
        result.closest = closest(args, cluster, estimates, consts)
    return result


def closest(
    args: ModelArgs, cluster: Cluster, estimates: list[Estimate], consts: Constants
) -> Estimate | None:
    """The fastest layout whose memory floor fits and that the trainer refuses, if at all, only
    for a limit of its own (`Finding.trainer_limit`: context parallelism, DDP under TP, ...):
    what a published run that another engine ran looks like when no layout is usable."""
    possible = [e for e in estimates if e.memory_verdict != "does not fit"]
    for e in possible:
        if not e.step_time_s:
            add_time(e, args, cluster, consts)
    for e in sorted(possible, key=lambda e: (not e.fits, e.step_time_s)):
        refusals = trainer_errors(args, e.layout, cluster)
        if all(f.trainer_limit for f in refusals):
            e.illegal = [f"{f.key}: {f.message}" for f in refusals]
            return e
    return None


def alternatives(
    args: ModelArgs,
    cluster: Cluster,
    winner: Estimate,
    estimates: list[Estimate],
    consts: Constants,
) -> list[tuple[str, Estimate, str]]:
    """For each knob, the best layout that differs from the winner in that knob only, and why it
    loses."""
    found = []
    for knob in KNOBS:
        rivals = [e for e in estimates if _differs_only_in(e.layout, winner.layout, knob)]
        if not rivals:
            continue
        for e in rivals:
            if e.fits and not e.step_time_s:
                add_time(e, args, cluster, consts)
            if e.fits and e.illegal == []:
                e.illegal = [f.message for f in trainer_errors(args, e.layout, cluster)]
        best = min(rivals, key=_preference)
        found.append((knob, best, why_it_loses(best, winner)))
    return found


def _differs_only_in(layout: Layout, winner: Layout, knob: str) -> bool:
    mine, theirs = layout.__dict__, winner.__dict__
    coupled = {"tp": {"dp", "sequence_parallel"}, "pp": {"dp"}, "schedule": {"virtual_stages"}}
    free = {knob} | coupled.get(knob, set())
    return getattr(layout, knob) != getattr(winner, knob) and all(
        mine[k] == theirs[k] for k in mine if k not in free
    )


def _preference(e: Estimate) -> tuple:
    """Usable first (fastest), then fitting-but-illegal, then by memory."""
    return (not e.usable, not e.fits, e.step_time_s if e.usable else e.memory.peak)


def why_it_loses(rival: Estimate, winner: Estimate) -> str:
    if not rival.fits:
        return (
            f"out of memory: {rival.memory.peak / GiB:.1f} GiB per GPU > "
            f"{rival.hbm_bytes / GiB:.1f} GiB"
        )
    if rival.illegal:
        return f"not legal in the trainer: {rival.illegal[0]}"
    slower = rival.step_time_s / winner.step_time_s - 1
    causes = []
    if rival.bubble_fraction > winner.bubble_fraction + 0.01:
        causes.append(f"bubble {_pct(winner.bubble_fraction)} -> {_pct(rival.bubble_fraction)}")
    if rival.comm_exposed_fraction > winner.comm_exposed_fraction + 0.01:
        causes.append(
            f"exposed comm {_pct(winner.comm_exposed_fraction)} -> "
            f"{_pct(rival.comm_exposed_fraction)}"
        )
    if rival.compute_s > winner.compute_s * 1.01:
        causes.append(f"compute {winner.compute_s:.2f} s -> {rival.compute_s:.2f} s per step")
    reason = ", ".join(causes) or "the same costs, rounded"
    return f"{100 * slower:.0f}% slower ({reason})"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"
