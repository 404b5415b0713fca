"""Batch arithmetic: global = micro x grad_accum x dp, with the missing term inferred as DeepSpeed
does (`DeepSpeedConfig._configure_train_batch_size`). The trainer, `check` and the planner share
it (`run_batch`).

Under pipeline parallelism the accumulation steps are the pipeline's micro-batches, and one is
never enough (upstream's schedules refuse fewer micro-batches than pipeline ranks). So when no
term fixes the accumulation (no global batch, no grad_accum_steps), a pipelined run takes
`parallel.num_microbatches` if given, else enough micro-batches to keep the default of 16
sequences per data-parallel rank and step, and at least the schedule's minimum: `--set
parallel.pp=2 --set train.micro_batch_size=4` trains 4 micro-batches of 4, as 16 sequences do
without PP."""

from dataclasses import dataclass
from typing import Any

from dstrain.config.findings import Finding, error, info

DEFAULT_MICRO_BATCH = 16  # and so the default batch per data-parallel rank and step


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    dp: int

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch_size} = micro {self.micro_batch_size} x grad_accum "
            f"{self.grad_accum_steps} x dp {self.dp}"
        )


def run_batch(config: Any, dp: int) -> tuple[BatchPlan | None, list[Finding]]:
    """The batch of a `DstrainConfig` on `dp` data-parallel ranks (see the module docstring)."""
    t, p = config.train, config.parallel
    pipeline = None
    if p.pp > 1:
        pipeline = p.num_microbatches or fewest_microbatches(p)
    return resolve_batch(
        t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, dp, pipeline=pipeline
    )


def fewest_microbatches(parallel: Any) -> int:
    """The fewest micro-batches a pipeline step may have (`rules.rule_pipeline_microbatches`
    refuses fewer): one per stage for DualPipeV, one per pipeline rank otherwise."""
    if parallel.pp_schedule == "dualpipev":
        return parallel.pp * parallel.num_virtual_stages
    return parallel.pp


def resolve_batch(
    micro: int | None,
    global_: int | None,
    accum: int | None,
    dp: int,
    *,
    pipeline: int | None = None,
) -> tuple[BatchPlan | None, list[Finding]]:
    """Fill the missing batch terms for `dp` data-parallel ranks; None plus errors when the given
    terms cannot agree. `pipeline`: under PP, the micro-batches it takes when nothing else fixes
    the accumulation (an explicit count, or the schedule's fewest)."""
    if micro and global_ and accum:
        if micro * accum * dp != global_:
            return None, [_mismatch(micro, global_, accum, dp)]
        return BatchPlan(micro, accum, global_, dp), []
    if global_ and (micro or accum):
        known, name = (micro, "micro_batch_size") if micro else (accum, "grad_accum_steps")
        other = "grad_accum_steps" if micro else "micro_batch_size"
        if global_ % (known * dp):
            return None, [_indivisible(global_, f"{name} x dp = {known} x {dp}", other)]
        value = global_ // (known * dp)
        plan = BatchPlan(micro or value, accum or value, global_, dp)
        return plan, [info(f"train.{other}", f"inferred {other} = {value} ({plan.describe()})")]
    if global_:
        if global_ % dp:
            return None, [_indivisible(global_, f"dp = {dp}", "micro_batch_size")]
        plan = BatchPlan(global_ // dp, 1, global_, dp)
        return plan, [info("train.micro_batch_size", f"inferred {plan.describe()}")]
    if pipeline and not accum:
        return _pipelined(micro, pipeline, dp)
    micro, accum = micro or DEFAULT_MICRO_BATCH, accum or 1
    plan = BatchPlan(micro, accum, micro * accum * dp, dp)
    return plan, [info("train.global_batch_size", f"inferred {plan.describe()}")]


def _pipelined(micro: int | None, fewest: int, dp: int) -> tuple[BatchPlan, list[Finding]]:
    if micro:
        accum = max(fewest, -(-DEFAULT_MICRO_BATCH // micro))
    else:
        accum, micro = fewest, max(1, DEFAULT_MICRO_BATCH // fewest)
    plan = BatchPlan(micro, accum, micro * accum * dp, dp)
    return plan, [
        info(
            "train.grad_accum_steps",
            f"inferred {plan.describe()}: {accum} micro-batches per pipeline step",
        )
    ]


def _mismatch(micro: int, global_: int, accum: int, dp: int) -> Finding:
    return error(
        "train.global_batch_size",
        f"global_batch_size {global_} != micro_batch_size {micro} x grad_accum_steps {accum} x "
        f"dp {dp} = {micro * accum * dp} (DeepSpeed: train_batch_size != "
        "train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size / (tp x pp))",
        "give only two of the three and let the third be inferred, or make them agree: "
        f"e.g. grad_accum_steps = {max(1, global_ // max(1, micro * dp))}",
    )


def _indivisible(global_: int, divisor: str, target: str) -> Finding:
    return error(
        "train.global_batch_size",
        f"global_batch_size {global_} does not divide by {divisor}, so {target} is not a whole "
        "number",
        "choose a global batch that is a multiple of it, or change the data-parallel size",
    )
