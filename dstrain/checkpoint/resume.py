"""Can a checkpoint resume under a new config, and what changes on the way?

DCP stores every tensor under its fully qualified name with its global shape, so loading
reshards the model and optimizer state onto any layout: dp_replicate, dp_shard, tp, pp (layers
keep their names across stage splits), ep, the ZeRO stage and the pipeline schedule may all change.
The data loader resumes from a global sample position, so a new dp degree only changes how each
step's samples are split among ranks.

What cannot carry over, and makes a resume fail:
  - any architecture field (ModelArgs) that differs: weights of another shape or meaning;
  - another optimizer kind: its state has other entries;
  - a world size the new layout does not fit;
  - a model-only checkpoint, which holds no optimizer, schedule or data position.

Plain Python on JSON metadata (the manifest), so `dstrain ckpt diff` needs no torch; the trainer
can call `compare` to refuse a resume for the same reasons.
"""

from dataclasses import asdict, dataclass, field
from typing import Any

from dstrain.config.flavors import resolve_model_args
from dstrain.config.parallel_dims import ParallelDims
from dstrain.config.schema import DstrainConfig

AXES = (
    "dp_replicate",
    "dp_shard",
    "cp",
    "tp",
    "pp",
    "ep",
    "zero_stage",
    "pp_schedule",
    "num_virtual_stages",
)
_PIPELINE_ONLY = {"pp_schedule", "num_virtual_stages"}  # meaningless while pp = 1 on both sides


@dataclass(frozen=True)
class AxisChange:
    axis: str
    old: Any  # None when the checkpoint does not record it
    new: Any
    status: str  # "same", "reshards", "unused" (pipeline settings without pp), "unknown"

    def describe(self) -> str:
        if self.status == "same":
            return f"same ({self.new})"
        if self.status == "unknown":
            return f"unknown: the checkpoint does not record it (now {self.new})"
        if self.status == "unused":
            return f"unused without pipeline parallelism ({self.old} -> {self.new})"
        return f"reshards: {self.old} -> {self.new}"


@dataclass(frozen=True)
class Blocker:
    key: str  # "model.dim", "optim.name", "parallel.zero_stage", "parallel", "kind"
    message: str


@dataclass
class ResumeDiff:
    step: int | None
    old_world_size: int | None
    new_world_size: int
    axes: list[AxisChange]
    data: str
    blockers: list[Blocker] = field(default_factory=list)

    @property
    def can_resume(self) -> bool:
        return not self.blockers

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "can_resume": self.can_resume}


def new_layout(config: DstrainConfig, world_size: int) -> dict[str, Any]:
    """The layout a config takes on `world_size` ranks, keyed as in the checkpoint's meta."""
    dims, p = ParallelDims.of(config.parallel, world_size), config.parallel
    return {
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "cp": dims.cp,
        "tp": dims.tp,
        "pp": dims.pp,
        "ep": dims.ep,
        "zero_stage": p.zero_stage,
        "pp_schedule": p.pp_schedule,
        "num_virtual_stages": p.num_virtual_stages,
    }


def compare(meta: dict[str, Any], config: DstrainConfig, world_size: int) -> ResumeDiff:
    """Resuming the checkpoint described by `meta` (its manifest) under `config` on
    `world_size` ranks: what reshards, and what blocks it."""
    old = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
    new = new_layout(config, world_size)
    both_without_pp = old.get("pp", 1) == 1 and new["pp"] == 1
    axes = [_axis(a, old.get(a), new[a], both_without_pp) for a in AXES]
    blockers = [
        *_kind_blockers(meta),
        *_model_blockers(
            meta.get("model"), resolve_model_args(config.model).model_dump(mode="json")
        ),
        *_optimizer_blockers(meta.get("optimizer"), config.optim.name),
        *_layout_blockers(config, world_size),
    ]
    return ResumeDiff(
        step=meta.get("step"),
        old_world_size=meta.get("world_size"),
        new_world_size=world_size,
        axes=axes,
        data=_data_line(meta, old, new),
        blockers=blockers,
    )


def _axis(axis: str, old: Any, new: Any, both_without_pp: bool) -> AxisChange:
    if old is None:
        return AxisChange(axis, old, new, "unknown")
    if old == new:
        return AxisChange(axis, old, new, "same")
    if axis in _PIPELINE_ONLY and both_without_pp:
        return AxisChange(axis, old, new, "unused")
    return AxisChange(axis, old, new, "reshards")


def _data_line(meta: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> str:
    tokens = meta.get("tokens_seen")
    seen = f" ({tokens:,} tokens seen)" if isinstance(tokens, int) else ""
    where = f"continues from the checkpoint's global sample position{seen}"
    if "dp_replicate" not in old or "dp_shard" not in old:
        return where
    old_dp = old["dp_replicate"] * old["dp_shard"]
    new_dp = new["dp_replicate"] * new["dp_shard"]
    if old_dp == new_dp:
        return where
    return f"{where}; dp {old_dp} -> {new_dp} only changes how each step's samples are split"


def _kind_blockers(meta: dict[str, Any]) -> list[Blocker]:
    if meta.get("kind", "full") == "full":
        return []
    return [
        Blocker(
            "kind",
            "a model-only checkpoint holds no optimizer state, schedule or data position to "
            "resume; start a new run from its weights instead",
        )
    ]


# ModelArgs fields that weight the loss, steer training or extend the context without changing a
# weight's shape or meaning: they may change across a resume (a new MTP weight, YaRN extension).
FREE_FIELDS = frozenset(
    {
        "mtp_loss_weight",
        "aux_loss_alpha",
        "bias_update_speed",
        "max_seq_len",
        "rope_theta",
        "rope_factor",
        "original_seq_len",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    }
)
_MISSING = "(absent)"


def architecture_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint's value, new value) for each architecture field that differs."""
    return [
        (name, old.get(name, _MISSING), new.get(name, _MISSING))
        for name in sorted(old.keys() | new.keys())
        if name not in FREE_FIELDS and old.get(name, _MISSING) != new.get(name, _MISSING)
    ]


def _model_blockers(old: Any, new: dict[str, Any]) -> list[Blocker]:
    if not isinstance(old, dict):
        return [Blocker("model", "the checkpoint does not record its architecture")]
    return [
        Blocker(
            f"model.{name}",
            f"{before!r} -> {after!r}: the architecture differs, so the weights cannot carry over",
        )
        for name, before, after in architecture_changes(old, new)
    ]


def _optimizer_blockers(old: Any, new: str) -> list[Blocker]:
    if old is None:
        return [Blocker("optim.name", "the checkpoint does not record its optimizer")]
    if old != new:
        return [
            Blocker(
                "optim.name",
                f"{old} -> {new}: optimizer state does not carry over to another optimizer",
            )
        ]
    return []


def _layout_blockers(config: DstrainConfig, world_size: int) -> list[Blocker]:
    found = [
        Blocker(f.key, f.message)
        for f in ParallelDims.of(config.parallel, world_size).validate()
        if f.severity == "error"
    ]
    return found
