"""The pre-flight rules `dstrain check` runs, and the trainer runs again before building anything.

Each rule is a small function of a `CheckTarget` that returns findings. `RULES` lists them in the
order they are reported; `dstrain check --rules` prints their one-line descriptions.
"""

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dstrain.config.batch import BatchPlan, fewest_microbatches, run_batch
from dstrain.config.findings import Finding, error, info, trainer_limit, warning
from dstrain.config.model_args import ModelArgs
from dstrain.config.parallel_dims import (
    ParallelDims,
    stage_trim,
    tp_spans_nodes,
)
from dstrain.config.schema import DstrainConfig
from dstrain.errors import UserError
from dstrain.hardware import BLOCKWISE_FP8_GPUS, GPUSpec, gpu_spec, network_gbps


@dataclass(frozen=True)
class CheckTarget:
    """What the rules look at. `world_size`, `model` and `gpu` are None when not known."""

    config: DstrainConfig
    world_size: int | None
    model: ModelArgs | None
    gpu: GPUSpec | None
    engine: str | None = None  # the foreign engine of an imported file; None = dstrain's own

    @property
    def steps_known(self) -> bool:
        """The run length is the file's, not dstrain's default (an imported file may not say)."""
        return self.engine is None or "steps" in self.config.train.model_fields_set

    @property
    def dims(self) -> ParallelDims | None:
        p = self.config.parallel
        world = self.world_size
        if world is None and p.dp_shard != -1:
            world = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
        if world is None:
            return None
        return ParallelDims.of(p, world)

    @property
    def batch(self) -> BatchPlan | None:
        dims = self.dims
        if dims is None or dims.dp < 1 or dims.validate():
            return None
        plan, _ = run_batch(self.config, dims.dp)
        return plan

    @property
    def num_microbatches(self) -> int | None:
        n = self.config.parallel.num_microbatches
        if n is not None:
            return n
        plan = self.batch
        if plan is not None:
            return plan.grad_accum_steps
        return self.config.train.grad_accum_steps


Rule = Callable[[CheckTarget], Iterable[Finding]]


def rule_world_size(t: CheckTarget) -> Iterable[Finding]:
    """The parallel degrees multiply to the world size; ep folds inside dp_shard x cp x tp."""
    dims = t.dims
    if dims is None:
        yield info(
            "parallel",
            "world size unknown: the degree and batch checks need it",
            "pass --world-size N (or --nodes N --gpus-per-node G), or set cluster.nodes/"
            "cluster.gpus_per_node",
        )
        return
    problems = dims.validate()
    yield from problems
    if not problems:
        yield info("parallel", f"layout: {dims.describe()}")
    c = t.config.cluster
    if t.world_size and "nodes" in c.model_fields_set and t.world_size != c.nodes * c.gpus_per_node:
        yield error(
            "cluster",
            f"cluster.nodes x cluster.gpus_per_node = {c.nodes * c.gpus_per_node}, but the world "
            f"size is {t.world_size}",
            "make them agree, or drop --world-size to use the cluster section",
        )
    if span := tp_spans_nodes(dims, c.gpus_per_node):
        yield span


def rule_batch(t: CheckTarget) -> Iterable[Finding]:
    """global batch = micro batch x gradient accumulation x dp; the missing one is inferred."""
    dims = t.dims
    tr = t.config.train
    if dims is None or dims.dp < 1 or dims.validate():
        if tr.global_batch_size and tr.micro_batch_size and tr.grad_accum_steps:
            per_dp, rest = divmod(tr.global_batch_size, tr.micro_batch_size * tr.grad_accum_steps)
            if rest:
                yield error(
                    "train.global_batch_size",
                    f"global_batch_size {tr.global_batch_size} is not a multiple of micro "
                    f"{tr.micro_batch_size} x grad_accum {tr.grad_accum_steps}, for any dp",
                    "make global = micro x grad_accum x dp",
                )
            else:
                yield info("train", f"the batch sizes imply dp = {per_dp}")
        return
    _, findings = run_batch(t.config, dims.dp)
    yield from findings


def rule_pipeline_shape(t: CheckTarget) -> Iterable[Finding]:
    """Stages per rank fit the schedule: 1 for gpipe/1f1b, >=2 interleaved, exactly 2 V-shaped."""
    p = t.config.parallel
    v, schedule = p.num_virtual_stages, p.pp_schedule
    if p.pp == 1:
        if v > 1:
            yield warning(
                "parallel.num_virtual_stages", f"{v} stages per rank has no effect at pp=1"
            )
        return
    if schedule in ("zbv", "dualpipev") and v != 2:
        yield error(
            "parallel.num_virtual_stages",
            f"{schedule} is V-shaped: it needs exactly 2 stages per rank (stages r and 2pp-1-r), "
            f"got num_virtual_stages={v}",
            "set parallel.num_virtual_stages = 2",
        )
    elif schedule == "interleaved-1f1b" and v < 2:
        yield error(
            "parallel.num_virtual_stages",
            "interleaved-1f1b needs at least 2 stages per rank",
            "set parallel.num_virtual_stages >= 2, or use pp_schedule = 1f1b",
        )
    elif schedule in ("gpipe", "1f1b") and v != 1:
        yield error(
            "parallel.num_virtual_stages",
            f"{schedule} runs one stage per rank, got num_virtual_stages={v}",
            "use pp_schedule = interleaved-1f1b for several stages per rank, or set it to 1",
        )


# Schedules whose order pairs a forward chunk with a backward chunk (upstream's OVERLAP_F_B):
# what `parallel.pp_overlap` overlaps (`parallel/pipeline_overlap.py`, which checks the order).
OVERLAPPED_SCHEDULES = ("dualpipev",)


def rule_pipeline_overlap(t: CheckTarget) -> Iterable[Finding]:
    """pp_overlap = true asks for something only DualPipeV has."""
    p = t.config.parallel
    if p.pp_overlap is not True:
        return
    if p.pp == 1 or p.pp_schedule not in OVERLAPPED_SCHEDULES:
        what = "pp = 1" if p.pp == 1 else f"pp_schedule = {p.pp_schedule}"
        yield warning(
            "parallel.pp_overlap",
            f"pp_overlap = true does nothing with {what}: only dualpipev pairs one micro-batch's "
            "forward chunk with another's backward chunk (OVERLAP_F_B actions) to overlap",
            "use pp_schedule = dualpipev with pp > 1, or leave pp_overlap unset",
        )


def rule_pipeline_microbatches(t: CheckTarget) -> Iterable[Finding]:
    """Enough micro-batches for the schedule (upstream raises or hangs otherwise)."""
    p = t.config.parallel
    m = t.num_microbatches
    if p.pp == 1 or m is None:
        return
    plan = t.batch
    if p.num_microbatches and plan and p.num_microbatches != plan.grad_accum_steps:
        yield error(
            "parallel.num_microbatches",
            f"num_microbatches={p.num_microbatches} but grad_accum_steps={plan.grad_accum_steps}:"
            " under PP the micro-batches of one step are the accumulation steps",
            "drop one of them (the other is inferred) or make them equal",
        )
    needed = fewest_microbatches(p)
    if m < needed:
        what = "stages" if p.pp_schedule == "dualpipev" else "pipeline ranks"
        yield trainer_limit(  # Megatron-LM runs m < p (most of the step idle)
            "parallel.num_microbatches",
            f"{m} micro-batch(es) per step for {needed} {what} under {p.pp_schedule}: upstream "
            "rejects it (or the pipeline idles most of the step)",
            f"use at least {needed} micro-batches (raise grad_accum_steps / global_batch_size); "
            f"{4 * needed} or more keeps the bubble small",
        )
    rounds = max(1, m // p.pp)
    if p.pp_schedule in ("interleaved-1f1b", "zbv") and m % rounds:
        yield error(
            "parallel.num_microbatches",
            f"{p.pp_schedule} runs micro-batches in rounds of pp; {m} is not a multiple of "
            f"{rounds} rounds",
            f"use a multiple of pp={p.pp} micro-batches",
        )


def rule_pipeline_layers(t: CheckTarget) -> Iterable[Finding]:
    """Layers divide evenly over pp x virtual stages, after first/last-stage trimming."""
    p, model = t.config.parallel, t.model
    if model is None or p.pp == 1:
        return
    stages = p.pp * p.num_virtual_stages
    if model.num_layers < stages:
        yield trainer_limit(  # other engines give a stage only the embedding or the head
            "parallel.pp",
            f"{model.num_layers} layers cannot fill {stages} pipeline stages (pp {p.pp} x "
            f"{p.num_virtual_stages} per rank)",
            "lower pp or num_virtual_stages so that every stage holds at least one layer",
        )
        return
    first, last = stage_trim(
        model.num_layers, stages, p.pp_first_stage_less_layers, p.pp_last_stage_less_layers
    )
    total = model.num_layers + first + last
    if total % stages == 0 and total // stages - max(first, last) >= 0:
        return
    a, b = stage_trim(model.num_layers, stages, None, None)
    yield error(
        "parallel.pp",
        f"{model.num_layers} layers (+{first} first, +{last} last trimmed) do not split evenly "
        f"over {stages} stages (pp {p.pp} x {p.num_virtual_stages} per rank)",
        f"set pp_first_stage_less_layers={a} and pp_last_stage_less_layers={b} (the embedding, "
        "head and MTP take the place of layers), or change pp / num_virtual_stages",
    )


def rule_experts(t: CheckTarget) -> Iterable[Finding]:
    """Routed experts divide by ep; group-limited routing is consistent."""
    p, m = t.config.parallel, t.model
    if m is None:
        return
    if p.ep > 1 and not m.is_moe:
        yield error("parallel.ep", f"ep={p.ep} but the model has no routed experts", "set ep = 1")
    elif p.ep > 1 and m.num_routed_experts % p.ep:
        yield error(
            "parallel.ep",
            f"{m.num_routed_experts} routed experts do not divide over ep={p.ep}",
            "choose ep among the divisors of num_routed_experts",
        )
    if not m.is_moe:
        return
    if m.num_routed_experts % m.n_group or m.topk_group > m.n_group:
        yield error(
            "model.n_group",
            f"group-limited routing needs n_group | num_routed_experts and topk_group <= n_group "
            f"(got {m.num_routed_experts} experts, n_group {m.n_group}, topk_group {m.topk_group})",
            "set n_group to a divisor of num_routed_experts and topk_group <= n_group",
        )
    elif m.num_activated_experts > m.topk_group * (m.num_routed_experts // m.n_group):
        yield error(
            "model.num_activated_experts",
            f"top-{m.num_activated_experts} cannot be chosen from {m.topk_group} group(s) of "
            f"{m.num_routed_experts // m.n_group} experts",
            "raise topk_group or lower num_activated_experts",
        )


def rule_tensor_parallel(t: CheckTarget) -> Iterable[Finding]:
    """Heads, kv heads, vocab and FFN widths divide by tp; SP needs seq_len divisible by tp."""
    p, m = t.config.parallel, t.model
    if p.tp == 1:
        if p.sequence_parallel and "sequence_parallel" in p.model_fields_set:
            yield info("parallel.sequence_parallel", "has no effect at tp=1")
        return
    if p.sequence_parallel and t.config.train.seq_len % p.tp:
        yield error(
            "train.seq_len",
            f"sequence parallel shards seq_len={t.config.train.seq_len} over tp={p.tp}",
            f"use a seq_len that is a multiple of {p.tp}",
        )
    if m is None:
        return
    widths = {
        "model.num_heads": m.num_heads,
        "model.num_kv_heads": m.kv_heads,
        "model.vocab_size": m.vocab_size,
        "model.inter_dim": m.inter_dim,
    }
    if m.is_moe and m.num_shared_experts:
        widths["model.moe_inter_dim"] = m.moe_inter_dim * m.num_shared_experts
    for key, value in widths.items():
        if value % p.tp == 0:
            continue
        if key == "model.num_kv_heads" and p.tp % value == 0:
            # Megatron-Core accepts query groups that divide tp (transformer_config.py: "must be
            # a multiple or divisor of tensor_model_parallel_size"), replicating each kv head.
            yield trainer_limit(
                key,
                f"num_kv_heads={value} is fewer than tp={p.tp}: each kv head would be replicated "
                "over tp / kv ranks, which dstrain's attention sharding does not do",
                f"use tp <= {value}",
            )
            continue
        yield error(
            key,
            f"{key.split('.')[1]}={value} does not divide by tp={p.tp}",
            f"choose tp among the divisors of {value}, or change {key}",
        )


def rule_zero(t: CheckTarget) -> Iterable[Finding]:
    """ZeRO stage fits the runtime: not 3 with PP; offload needs FSDP; hooks need DDP."""
    p, comm = t.config.parallel, t.config.comm
    if p.zero_stage == 3 and p.pp > 1:
        yield trainer_limit(
            "parallel.zero_stage",
            "ZeRO-3 with pipeline parallelism: the stages would all-gather their parameters once "
            "per micro-batch, and upstream pipelining keeps FSDP modules unsharded for the whole "
            "step anyway, so stage 3 buys no memory over stage 2",
            "use zero_stage = 1 or 2 with pp > 1 (DeepSpeed's pipeline engine allows only 0-1)",
        )
    if p.offload_optimizer and p.zero_stage < 2:
        yield trainer_limit(  # DeepSpeed offloads at stage 1 too (zero/stage_1_and_2.py)
            "parallel.offload_optimizer",
            f"optimizer offload needs FSDP (zero_stage >= 2), got zero_stage={p.zero_stage}",
            "set parallel.zero_stage = 2 or 3, or turn offload off",
        )
    elif p.offload_optimizer and not p.offload_params:
        yield warning(
            "parallel.offload_optimizer",
            "FSDP2's CPU offload also keeps the sharded parameters and gradients on the CPU",
            "expect parameter host-device traffic too; set offload_params = true to say so",
        )
    if p.offload_params and p.zero_stage != 3:
        yield error(
            "parallel.offload_params",
            f"parameter offload needs zero_stage=3 (parameters are only partitioned there), got "
            f"{p.zero_stage}",
            "set zero_stage = 3, or offload_params = false",
        )
    dims = t.dims
    if dims and dims.dp > 1 and dims.tp > 1 and p.zero_stage == 0:
        yield trainer_limit(
            "parallel.zero_stage",
            "tp > 1 with plain DDP (zero_stage 0): DDP cannot reduce tensor-parallel (DTensor) "
            "parameters; dstrain runs tp with data parallelism under FSDP2",
            "set parallel.zero_stage = 1 (Megatron's distributed optimizer), 2 or 3",
        )
    if comm.compression != "none" and p.zero_stage >= 1:
        yield error(
            "comm.compression",
            f"{comm.compression} compression is a DDP comm hook; FSDP2 (zero_stage "
            f"{p.zero_stage}) cannot take hooks",
            "use zero_stage 0 (DDP) with compression, or set comm.compression = none",
        )
    if dims and dims.dp_shard == 1 and p.zero_stage > 0 and dims.world_size > 1:
        yield info("parallel.zero_stage", f"ZeRO-{p.zero_stage} has nothing to shard at dp_shard=1")


def rule_precision(t: CheckTarget) -> Iterable[Finding]:
    """The precision suits the hardware (bf16 where it exists; never fp16 compute on CPU)."""
    precision, gpu = t.config.train.precision, t.gpu
    is_cpu = (t.config.cluster.gpu or "").lower() == "cpu"
    if precision == "fp16" and is_cpu:
        yield warning(
            "train.precision",
            "fp16 matmuls on CPUs run at a tiny fraction of fp32 speed",
            "use bf16 (fast on AVX512-BF16/AMX CPUs) or fp32",
        )
    elif precision == "fp16" and (gpu is None or gpu.supports_bf16):
        where = gpu.name if gpu else "every GPU since A100"
        yield warning(
            "train.precision",
            f"fp16 chosen, but {where} supports bf16, which needs no loss scaling and does not "
            "overflow",
            "set train.precision = bf16 (DeepSpeed: bf16.enabled=true, fp16.enabled=false)",
        )
    if precision == "bf16" and gpu is not None and not gpu.supports_bf16:
        yield error(
            "train.precision",
            f"{gpu.name} has no bf16 support",
            "use fp16 with loss scaling on this GPU",
        )
    if precision == "fp8":
        yield from _fp8_device(t.config.train.fp8_backend, gpu, is_cpu)


def _fp8_device(backend: str, gpu: GPUSpec | None, is_cpu: bool) -> Iterable[Finding]:
    """What runs fp8's GEMMs (train/precision.py decides the same at start-up)."""
    if is_cpu:
        if backend == "scaled_mm":
            yield error(
                "train.fp8_backend",
                "scaled_mm on a CPU: the blockwise FP8 kernel is CUDA-only (SM90)",
                "set train.fp8_backend = auto (the emulation on a CPU)",
            )
        else:
            yield info(
                "train.precision",
                "fp8 on a CPU runs DeepSeek-V3's recipe as an exact emulation (E4M3 values, "
                "fp32 products): its numerics, not FP8 speed",
            )
        return
    if gpu is None or gpu.name in BLOCKWISE_FP8_GPUS:
        return
    has = "FP8 tensor cores but not the" if gpu.fp8_tflops else "no FP8 tensor cores, nor the"
    reason = (
        f"{gpu.name} has {has} blockwise 1x128/128x128 kernel torch runs on SM90 "
        f"({', '.join(sorted(BLOCKWISE_FP8_GPUS))})"
    )
    if backend == "emulated":
        yield warning(
            "train.fp8_backend",
            f"{reason}: the emulation will run, with FP8's numerics at far below bf16 speed",
            "train in bf16 on this GPU for speed",
        )
    else:
        yield error(
            "train.precision",
            reason,
            "train in bf16 on this GPU, or set train.fp8_backend = emulated to run the exact "
            "emulation (much slower than bf16)",
        )


def rule_fp8_tensor_parallel(t: CheckTarget) -> Iterable[Finding]:
    """Under fp8 with tp > 1, each rank's share of every TP-sharded FP8 width is whole 128-tiles
    (`parallel/fp8_tp.py` refuses the same at start-up)."""
    dims, args = t.dims, t.model
    if t.config.train.precision != "fp8" or dims is None or dims.tp == 1 or args is None:
        return
    for name, width in tp_sharded_fp8_widths(args):
        if width % dims.tp or (width // dims.tp) % 128:
            # dstrain's whole-tile shards; Transformer Engine pads its scales instead
            yield (error if width % dims.tp else trainer_limit)(
                "parallel.tp",
                f"fp8 with tp = {dims.tp}: {name} ({width} wide) splits into "
                f"{width / dims.tp:g} per rank, not a multiple of 128, so a 1x128 tile or "
                "128x128 block would straddle two ranks",
                f"choose tp so that {width} / tp is a multiple of 128, widen the model, or train "
                "in bf16",
            )
            return


def tp_sharded_fp8_widths(args: ModelArgs) -> list[tuple[str, int]]:
    """(layer, width) of every FP8 linear width that TP splits (tensor_parallel.py's plan):
    output features of the colwise layers, input features of the rowwise ones."""
    h = args.num_heads
    if args.attention == "mla":
        qk = args.qk_nope_head_dim + args.qk_rope_head_dim
        widths = [
            ("attention wq_b" if args.q_lora_rank else "attention wq", h * qk),
            ("attention wkv_b", h * (args.qk_nope_head_dim + args.v_head_dim)),
            ("attention wo", h * args.v_head_dim),
        ]
    else:
        head = args.head_dim or args.dim // h
        widths = [
            ("attention wq/wo", h * head),
            ("attention wk/wv", (args.num_kv_heads or h) * head),
        ]
    if args.first_k_dense or not args.num_routed_experts:
        widths.append(("dense FFN w1/w2/w3", args.inter_dim))
    if args.num_routed_experts and args.num_shared_experts:
        widths.append(("shared experts", args.num_shared_experts * args.moe_inter_dim))
    if args.num_mtp_modules:
        widths.append(("MTP proj", 2 * args.dim))
    return widths


def rule_optimizer(t: CheckTarget) -> Iterable[Finding]:
    """Learning rate and schedule are plausible for the run length."""
    c = t.config
    if c.optim.name in ("adam", "adamw") and not 1e-6 <= c.optim.lr <= 1e-2:
        side = "below" if c.optim.lr < 1e-6 else "above"
        yield warning(
            "optim.lr",
            f"lr={c.optim.lr:g} is far {side} the usual 1e-5..1e-3 for Adam-type optimizers",
            "check the exponent (pre-training LLMs uses ~1e-4..3e-3, fine-tuning ~1e-5..5e-5)",
        )
    if c.lr.warmup_steps >= c.train.steps and c.lr.schedule != "constant" and t.steps_known:
        yield warning(
            "lr.warmup_steps",
            f"warmup_steps={c.lr.warmup_steps} >= train.steps={c.train.steps}: the schedule "
            "never leaves warmup",
            "shorten the warmup (1-5% of the steps is usual)",
        )


def rule_model(t: CheckTarget) -> Iterable[Finding]:
    """The sequence fits the model's positions."""
    m = t.model
    if m is not None and t.config.train.seq_len > m.max_seq_len:
        yield error(
            "train.seq_len",
            f"seq_len={t.config.train.seq_len} exceeds the model's max_seq_len={m.max_seq_len}",
            "lower train.seq_len, or raise model.max_seq_len (with YaRN for long contexts)",
        )


def rule_paths(t: CheckTarget) -> Iterable[Finding]:
    """Data and resume paths exist; checkpoints happen before the end."""
    c = t.config
    if c.data.source != "embedded" and not Path(c.data.source).exists():
        yield error(
            "data.source",
            f"data path not found: {c.data.source}",
            "point data.source at a .txt/.jsonl/.parquet file or folder, or use `embedded`",
        )
    tokenizer = c.data.tokenizer
    if tokenizer not in ("bpe", "bytes") and not Path(tokenizer).exists():
        yield error(
            "data.tokenizer",
            f"tokenizer not found: {tokenizer}",
            "use `bpe`, `bytes`, or a path to a tokenizer.json or a Hugging Face tokenizer folder",
        )
    if c.model.init_from is not None and not (Path(c.model.init_from) / "config.json").exists():
        yield error(
            "model.init_from",
            f"{c.model.init_from} is not a Hugging Face checkpoint folder (no config.json)",
            "point model.init_from at a folder with config.json and *.safetensors",
        )
    if c.checkpoint.resume not in ("auto", "never") and not Path(c.checkpoint.resume).exists():
        yield error(
            "checkpoint.resume",
            f"checkpoint to resume from not found: {c.checkpoint.resume}",
            "pass an existing checkpoint directory, or `auto`/`never`",
        )
    if c.checkpoint.enable and c.checkpoint.interval > c.train.steps and t.steps_known:
        yield info(
            "checkpoint.interval",
            f"interval {c.checkpoint.interval} > steps {c.train.steps}: only the final "
            "checkpoint will be written",
        )


def rule_data(t: CheckTarget) -> Iterable[Finding]:
    """Document masking runs where its mask reaches every attention layer."""
    c = t.config
    if not c.data.document_mask:
        return
    if c.parallel.pp > 1:
        yield error(
            "data.document_mask",
            f"data.document_mask under pipeline parallelism (parallel.pp = {c.parallel.pp}): "
            "the stages hand each other hidden states only, not the documents' mask",
            "set parallel.pp = 1 (shard with dp_shard/tp/ep instead), or data.document_mask = "
            "false",
        )


def rule_context_parallel(t: CheckTarget) -> Iterable[Finding]:
    """Context parallelism: the sequence splits into 2 x cp equal chunks."""
    c = t.config
    cp = c.parallel.cp
    if cp == 1:
        return
    if c.train.seq_len % (2 * cp):
        fits = c.train.seq_len - c.train.seq_len % (2 * cp)
        yield error(
            "train.seq_len",
            f"seq_len {c.train.seq_len} does not split into 2 x cp = {2 * cp} equal chunks "
            "(each cp rank holds two: one early, one late, for equal causal work)",
            f"set train.seq_len to a multiple of {2 * cp}, e.g. {fits or 2 * cp}",
        )


def rule_cluster(t: CheckTarget) -> Iterable[Finding]:
    """The GPU and network names are in the hardware table; timeouts suit the scale."""
    c = t.config.cluster
    if c.gpu and c.gpu.lower() != "cpu":
        try:
            gpu_spec(c.gpu)
        except UserError as exc:
            yield error("cluster.gpu", exc.message, exc.fix)
    try:
        network_gbps(c.network)
    except UserError as exc:
        yield error("cluster.network", exc.message, exc.fix)
    if t.world_size and t.world_size >= 256 and t.config.comm.timeout_s < 300:
        yield warning(
            "comm.timeout_s",
            f"timeout {t.config.comm.timeout_s:g}s at {t.world_size} ranks: the first NCCL "
            "communicator setup and checkpoint barriers can take minutes",
            "use >= 600 s at this scale",
        )


def rule_metrics(t: CheckTarget) -> Iterable[Finding]:
    """The profiled steps exist; the exporter's ports fit; W&B is installed when asked for."""
    m, steps = t.config.metrics, t.config.train.steps
    if m.profile_steps:
        first, last = (int(n) for n in m.profile_steps.split(":"))
        if first > last:
            yield error(
                "metrics.profile_steps",
                f"profile_steps {m.profile_steps}: the first step is after the last",
                f"write it as {last}:{first}",
            )
        elif first > steps:
            yield warning(
                "metrics.profile_steps",
                f"profile_steps {m.profile_steps} starts after the run's last step ({steps}): "
                "nothing will be profiled",
                f"profile steps inside 1..{steps}, e.g. {min(5, steps)}:{min(7, steps)}",
            )
    if m.prometheus_port is not None and t.world_size:
        local = min(t.world_size, t.config.cluster.gpus_per_node or t.world_size)
        if m.prometheus_port + local - 1 > 65535:
            yield error(
                "metrics.prometheus_port",
                f"port {m.prometheus_port} + {local - 1} (rank r serves on port + local rank) "
                "passes 65535",
                f"use a port <= {65536 - local}",
            )
    if m.wandb and importlib.util.find_spec("wandb") is None:
        yield warning(
            "metrics.wandb",
            "metrics.wandb is on but the `wandb` package is not installed: training will stop "
            "when it starts its sinks",
            "pip install wandb, or set metrics.wandb = false",
        )


RULES: list[Rule] = [
    rule_world_size,
    rule_batch,
    rule_pipeline_shape,
    rule_pipeline_overlap,
    rule_pipeline_microbatches,
    rule_pipeline_layers,
    rule_experts,
    rule_tensor_parallel,
    rule_zero,
    rule_precision,
    rule_fp8_tensor_parallel,
    rule_optimizer,
    rule_model,
    rule_paths,
    rule_data,
    rule_context_parallel,
    rule_cluster,
    rule_metrics,
]


def run_rules(target: CheckTarget) -> list[Finding]:
    return [finding for rule in RULES for finding in rule(target)]
