"""ParallelDims: the parallel degrees, how they fill the world, and whether they are legal.

Plain Python on purpose: `dstrain check`, the planner and the trainer all call `validate()` here,
so legal in the planner means legal in the trainer. `dstrain/parallel/` builds the meshes from it.

The axes, outermost first: pp, dp_replicate, dp_shard, cp, tp.
    world_size = pp x dp_replicate x dp_shard x cp x tp

Expert parallelism folds over the data and tensor axes (torchtitan's rule):
    dp_shard x cp x tp = ep x efsdp
The routed experts are split over `ep` ranks, and under FSDP (zero_stage >= 2) each expert's
weights are ZeRO-sharded over the remaining `efsdp` ranks. So ep must divide dp_shard x cp x tp;
it adds no ranks of its own.
"""

from dataclasses import dataclass

from dstrain.config.findings import Finding, error, warning
from dstrain.config.schema import ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def resolve(
        cls,
        *,
        dp_replicate: int,
        dp_shard: int,
        cp: int,
        tp: int,
        pp: int,
        ep: int,
        world_size: int,
    ) -> "ParallelDims":
        """Fill dp_shard=-1 with what the world size leaves (0 when it does not divide, which
        `validate` then reports)."""
        if dp_shard == -1:
            others = dp_replicate * cp * tp * pp
            dp_shard = world_size // others if world_size % others == 0 else 0
        return cls(dp_replicate, dp_shard, cp, tp, pp, ep, world_size)

    @classmethod
    def of(cls, parallel: "ParallelConfig", world_size: int) -> "ParallelDims":
        """The degrees of a config's `parallel` section on `world_size` ranks."""
        p = parallel
        return cls.resolve(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            cp=p.cp,
            tp=p.tp,
            pp=p.pp,
            ep=p.ep,
            world_size=world_size,
        )

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks over which each expert's weights are sharded (0 when ep does not fold)."""
        span = self.dp_shard * self.cp * self.tp
        return span // self.ep if self.ep and span % self.ep == 0 else 0

    def describe(self) -> str:
        axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        shown = " x ".join(f"{a}{getattr(self, a)}" for a in axes if getattr(self, a) != 1)
        ep = f", ep{self.ep} over dp_shard x cp x tp (efsdp {self.efsdp})" if self.ep > 1 else ""
        return f"{shown or 'one rank'} = {self.world_size} ranks{ep}"

    def validate(self) -> list[Finding]:
        """Every problem with the degrees themselves (not with the model or batch)."""
        problems = [f for f in (self._check_world(), self._check_ep()) if f]
        return problems

    def _check_world(self) -> Finding | None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if self.world_size < 1:
            return error("parallel", f"world size {self.world_size} must be >= 1")
        if self.dp_shard == 0 or self.dp_shard < -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            return error(
                "parallel.dp_shard",
                f"world size {self.world_size} does not divide by dp_replicate x cp x tp x pp "
                f"= {others}, so no dp_shard fills it",
                f"use a world size that is a multiple of {others}, or lower tp/pp",
            )
        if product != self.world_size:
            return error(
                "parallel",
                f"dp_replicate x dp_shard x cp x tp x pp = {self.dp_replicate} x {self.dp_shard} "
                f"x {self.cp} x {self.tp} x {self.pp} = {product}, but the world size is "
                f"{self.world_size}",
                "set parallel.dp_shard = -1 to fill the world, or change the degrees so their "
                "product equals the world size (ep folds inside and adds no ranks)",
            )
        return None

    def _check_ep(self) -> Finding | None:
        span = self.dp_shard * self.cp * self.tp
        if self.ep > 1 and span % self.ep != 0:
            return error(
                "parallel.ep",
                f"ep={self.ep} must divide dp_shard x cp x tp = {self.dp_shard} x {self.cp} x "
                f"{self.tp} = {span}: experts are split over ranks borrowed from those axes",
                f"choose ep among the divisors of {span}, or raise dp_shard",
            )
        return None


def tp_spans_nodes(dims: ParallelDims, gpus_per_node: int) -> Finding | None:
    """TP (and EP inside it) should stay inside a node, where the fast links are."""
    if dims.tp > gpus_per_node:
        return warning(
            "parallel.tp",
            f"tp={dims.tp} spans more than one node ({gpus_per_node} GPUs per node): every "
            "layer's all-reduce would cross the inter-node network",
            f"keep tp <= {gpus_per_node}; use pp or ep across nodes instead",
        )
    return None


def stage_trim(
    num_layers: int, num_stages: int, first: int | None, last: int | None
) -> tuple[int, int]:
    """Layers fewer on the first and last pipeline stage. Given values are kept; a None one is
    the smallest that makes num_layers + first + last divide by num_stages, and with both None
    the last stage (head and MTP) takes the larger half of what is needed."""
    if first is not None and last is not None:
        return first, last
    if first is None and last is None:
        extra = (-num_layers) % num_stages
        return extra // 2, extra - extra // 2
    if first is None:
        return (-(num_layers + last)) % num_stages, last
    return first, (-(num_layers + first)) % num_stages
