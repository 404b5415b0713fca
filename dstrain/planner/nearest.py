"""The layouts nearest a run's own that fit a memory budget, for the out-of-memory advice
(`planner/advice.py`), as the exact `--set` flags that turn the run's config into each.

The planner's search, constrained: its candidates (`candidates.py`) on the same GPUs and world
size, the precision and offload kept, the context-parallel degree as it is or doubled, the
micro-batch also halved, quartered, ... (a run's may be above the planner's 8); each gets
its memory estimate (`estimate.py`), and those under the budget are ordered by how many settings
they change (fewest first, at most MAX_CHANGES) and then by the planner's step time (fastest
first). They are put to the trainer's rules (`legal.config_errors`) on the run's config with the
flags applied, in that order, until `top` legal ones are found. A setting is one of SETTINGS;
the data-parallel degree follows the others (the world is fixed) and the virtual stages follow
the schedule, so neither counts.
"""

import shlex
from dataclasses import dataclass
from typing import Any

from dstrain.config.batch import run_batch
from dstrain.config.model_args import ModelArgs
from dstrain.config.overrides import apply_overrides, parse_override
from dstrain.config.schema import DstrainConfig
from dstrain.errors import UserError
from dstrain.planner.candidates import MICRO_BATCHES, candidates
from dstrain.planner.estimate import Constants, Estimate, add_time, estimate_memory
from dstrain.planner.layout import Cluster, Layout, layout_from_config
from dstrain.planner.legal import config_errors, virtual_stages
from dstrain.planner.memory import GiB

# What a suggestion may change, in the order its flags are written.
SETTINGS = (
    "micro_batch",
    "recompute",
    "zero",
    "tp",
    "pp",
    "ep",
    "cp",
    "schedule",
    "sequence_parallel",
)
MAX_CHANGES = 3
KEYS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "ep": "parallel.ep",
    "cp": "parallel.cp",
    "zero": "parallel.zero_stage",
    "schedule": "parallel.pp_schedule",
    "sequence_parallel": "parallel.sequence_parallel",
    "micro_batch": "train.micro_batch_size",
    "recompute": "train.activation_checkpoint",
}


@dataclass
class Suggestion:
    estimate: Estimate  # the planner's, with its step time
    changes: tuple[str, ...]  # the SETTINGS it changes
    flags: list[str]  # `section.key=value`, each one `--set` argument

    def command_line(self) -> str:
        """The flags as typed in a shell."""
        return " ".join(f"--set {shlex.quote(flag)}" for flag in self.flags)

    def to_json(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "flags": self.flags,
            "command_line": self.command_line(),
            "changes": list(self.changes),
            "layout": e.layout.describe(),
            "memory_gib": e.memory.peak / GiB,
            "step_time_s": e.step_time_s,
            "tokens_per_s": e.tokens_per_s,
        }


def nearest_fitting(
    args: ModelArgs,
    cluster: Cluster,
    config: DstrainConfig,
    current: Layout,
    budget_bytes: float,
    *,
    top: int = 5,
    consts: Constants | None = None,
) -> list[Suggestion]:
    """Up to `top` layouts whose estimate is at most `budget_bytes`, nearest `current` (the
    layout of `config` on `cluster.num_gpus` ranks) first, then fastest (module docstring)."""
    consts = consts or Constants()
    by_distance: dict[int, list[Estimate]] = {}
    for layout in _nearby(args, cluster, current):
        changed = len(changes(current, layout))
        if 0 < changed <= MAX_CHANGES:
            e = estimate_memory(args, layout, cluster)
            if e.memory.peak <= budget_bytes:
                by_distance.setdefault(changed, []).append(e)
    found: list[Suggestion] = []
    gpu = None if cluster.gpu.arch == "cpu" else cluster.gpu
    for distance in sorted(by_distance):
        group = by_distance[distance]
        for e in group:
            add_time(e, args, cluster, consts)
        for e in sorted(group, key=lambda e: e.step_time_s):
            flags = set_flags(config, current, e.layout)
            patched = _patched(config, flags, cluster.num_gpus, e.layout)
            if patched is None or config_errors(patched, cluster.num_gpus, args, gpu):
                continue
            found.append(Suggestion(e, changes(current, e.layout), flags))
            if len(found) == top:
                return found
    return found


def changes(current: Layout, other: Layout) -> tuple[str, ...]:
    """The SETTINGS in which `other` differs from `current` (sequence parallelism only where
    some tensor parallelism makes it mean something)."""
    out = []
    for name in SETTINGS:
        if name == "sequence_parallel" and max(current.tp, other.tp) == 1:
            continue
        if name == "schedule" and max(current.pp, other.pp) == 1:
            continue
        if getattr(current, name) != getattr(other, name) or (
            name == "schedule" and current.virtual_stages != other.virtual_stages
        ):
            out.append(name)
    return tuple(out)


def set_flags(config: DstrainConfig, current: Layout, target: Layout) -> list[str]:
    """The `--set` arguments that turn `config` (whose layout is `current`) into `target`: the
    settings that change, the data-parallel shard degree where the config fixes it, the virtual
    stages with the schedule, and the batch terms that keep the global batch."""
    flags = [f"{KEYS[name]}={_value(getattr(target, name))}" for name in changes(current, target)]
    p = config.parallel
    if target.dp != current.dp and p.dp_shard != -1:
        if target.dp % p.dp_replicate:
            flags += ["parallel.dp_replicate=1", f"parallel.dp_shard={target.dp}"]
        else:
            flags.append(f"parallel.dp_shard={target.dp // p.dp_replicate}")
    virtual = virtual_stages(target)
    if "schedule" in changes(current, target) and virtual != p.num_virtual_stages:
        flags.append(f"parallel.num_virtual_stages={virtual}")
    return flags + _batch_flags(config, flags, target)


def _batch_flags(config: DstrainConfig, flags: list[str], target: Layout) -> list[str]:
    """The batch terms to add so the patched config trains `target`'s micro-batch at the same
    global batch: the accumulation where the config fixes it, the global batch where it is
    inferred."""
    patched = _validated(config, flags)
    plan, _ = run_batch(patched, target.dp) if patched is not None else (None, [])
    wanted = (target.micro_batch, target.global_batch)
    if plan is not None and (plan.micro_batch_size, plan.global_batch_size) == wanted:
        return []
    extra = []
    t = config.train
    if t.grad_accum_steps is not None:
        extra.append(f"train.grad_accum_steps={target.microbatches}")
    if t.global_batch_size is None:
        extra.append(f"train.global_batch_size={target.global_batch}")
    if not any(f.startswith("train.micro_batch_size=") for f in flags):
        extra.append(f"train.micro_batch_size={target.micro_batch}")
    return extra


def _patched(
    config: DstrainConfig, flags: list[str], world: int, target: Layout
) -> DstrainConfig | None:
    """`config` with `flags` applied, if it trains `target` (None when the flags fall short)."""
    patched = _validated(config, flags)
    if patched is None:
        return None
    try:
        again = layout_from_config(patched, world)
    except UserError:
        return None
    same = (again.dp, again.global_batch) == (target.dp, target.global_batch)
    return patched if same and not changes(again, target) else None


def _validated(config: DstrainConfig, flags: list[str]) -> DstrainConfig | None:
    # Only the keys the run set (and the flags): a default left unset keeps meaning "derived".
    data = apply_overrides(config.model_dump(mode="json", exclude_unset=True), flags)
    try:
        return DstrainConfig.model_validate(data)
    except ValueError:
        return None


def _nearby(args: ModelArgs, cluster: Cluster, current: Layout):
    """The planner's candidates around `current`: its precision, offload and global batch, its
    context-parallel degree or twice it, and its micro-batch or a power-of-two share of it
    besides the planner's own (`candidates.MICRO_BATCHES`)."""
    fixed = {"cp", "micro_batch", "offload", "precision"}
    shares = {current.micro_batch >> k for k in range(current.micro_batch.bit_length())}
    for cp in (current.cp, 2 * current.cp):
        if cluster.num_gpus % cp or current.seq_len % (2 * cp):
            continue
        for micro_batch in sorted(shares | set(MICRO_BATCHES), reverse=True):
            base = current.with_(cp=cp, micro_batch=micro_batch)
            yield from candidates(args, cluster, base, fixed)


def _value(value: object) -> str:
    """A value as `--set` reads it back (`config/overrides.py`): TOML, or a bare string where
    that reads back the same (`selective`), quoted where it does not (`"none"`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        bare = parse_override(f"k={value}")[1]
        return value if bare == value else f'"{value}"'
    return str(value)
