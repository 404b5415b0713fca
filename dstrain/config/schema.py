"""The typed config tree: one section per concern, every field described.

Precedence: `--set section.key=value` on the command line > the config file > these defaults.
`dstrain config --explain [section.key]` prints the descriptions below.
"""

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from dstrain.config.model_args import ModelArgs

# Pipeline schedules that place two stages on each rank in a V (stages r and 2pp-1-r).
V_SHAPED = ("zbv", "dualpipev")


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _architecture_overrides() -> dict[str, Any]:
    """Every ModelArgs field as an optional override of the chosen flavor."""
    fields = {}
    for name, field in ModelArgs.model_fields.items():
        description = f"{field.description} None = the flavor's value."
        fields[name] = (field.annotation | None, Field(None, description=description))
    return fields


_ModelOverrides = create_model(  # type: ignore[call-overload]
    "_ModelOverrides", __base__=Section, **_architecture_overrides()
)


class ModelConfig(_ModelOverrides):  # type: ignore[misc, valid-type]
    """Which model: a flavor (or a Hugging Face config.json), then per-field overrides."""

    flavor: str | None = Field(
        None,
        description="Built-in architecture: debug, deepseek-v2-lite, deepseek-moe-16b, "
        "deepseek-v3, deepseek-llm-7b (`dstrain config --explain model` lists them). None = "
        "init_from's config.json when init_from is set, else debug.",
    )
    hf_config: Path | None = Field(
        None,
        description="A Hugging Face config.json (deepseek_v3, deepseek_v2, llama...) to read the "
        "architecture from instead of `flavor`. None = use the flavor (or init_from's).",
    )
    init_from: Path | None = Field(
        None,
        description="A Hugging Face DeepSeek-V2/V3 checkpoint folder (config.json, safetensors, "
        "index; FP8 with block scales too) whose weights the run starts from, each rank reading "
        "only the slices it holds. Its config.json gives the architecture unless `flavor` or "
        "`hf_config` is set; field overrides apply on top. The optimizer starts fresh; a resume "
        "from the run's own checkpoint takes precedence. None = random initial weights.",
    )


class ParallelConfig(Section):
    """How ranks are laid out. The product dp_replicate x dp_shard x cp x tp x pp is the world size;
    ep is carved out of dp_shard x cp x tp (see `ParallelDims`)."""

    dp_replicate: int = Field(
        1, ge=1, description="Data-parallel replicas (the outer, replicated axis of HSDP)."
    )
    dp_shard: int = Field(
        -1,
        description="Data-parallel ranks over which ZeRO shards (stage 1: optimizer states, "
        "2: + gradients, 3: + parameters; stage 0: plain data parallel). -1 = whatever the "
        "world size leaves after the other axes.",
    )
    cp: int = Field(
        1,
        ge=1,
        description="Context-parallel degree: each sequence split over cp ranks (2 x cp chunks, "
        "rank r holding chunks r and 2cp-1-r); attention gathers MLA's latent. Composes with "
        "dp_shard, tp and ep. 1 = off.",
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel degree. 1 = off.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree (ranks). 1 = off.")
    ep: int = Field(
        1,
        ge=1,
        description="Expert-parallel degree: routed experts are split over ep ranks taken from "
        "dp_shard x cp x tp. 1 = every rank holds every expert.",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2,
        description="ZeRO stage over the dp axes: 0 = DDP; 1 = sharded fp32 master weights "
        "and optimizer states, weights gathered once per step and gradients reduced once "
        "(Megatron's distributed optimizer, on FSDP2); 2 = also sharded gradients, reduced "
        "per micro-batch; 3 = also weights resharded after each block's forward. 1-3 compose "
        "with TP, EP, PP and checkpoints.",
    )
    sequence_parallel: bool = Field(
        True, description="Shard norms and dropout over the sequence when tp > 1."
    )
    ep_overlap: bool = Field(
        True,
        description="With ep > 1, run the shared experts while the routed tokens' dispatch "
        "all-to-all is in flight, instead of after the combine. Same numbers either way.",
    )
    moe_tp: Literal["split_tokens", "repeat"] = Field(
        "split_tokens",
        description="How tp ranks share the routed experts' work when tp > 1. split_tokens: each "
        "tp rank routes, dispatches and computes 1/tp of the tokens and the results are "
        "all-gathered (expert FLOPs, activations and EP bytes per rank / tp). repeat: every tp "
        "rank routes all tokens through the full experts (tp x the work; for comparison).",
    )
    offload_optimizer: bool = Field(
        False,
        description="ZeRO-Offload: optimizer states and step on the CPU (needs zero_stage>=2).",
    )
    offload_params: bool = Field(
        False, description="Keep sharded parameters on the CPU between uses (needs zero_stage=3)."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"] = Field(
        "1f1b",
        description="Pipeline schedule from torch.distributed.pipelining. zbv and dualpipev are "
        "V-shaped: exactly 2 stages per rank.",
    )
    pp_overlap: bool | None = Field(
        None,
        description="Overlap DualPipeV's paired forward and backward chunks (OVERLAP_F_B): each "
        "chunk's collectives (EP all-to-alls, TP) run while the other computes. None = on "
        "GPUs (NCCL's own stream) and off on CPUs (gloo shares the cores: no gain measured); "
        "true with a schedule other than dualpipev does nothing (a check warning); false = "
        "run the pairs one after the other.",
    )
    num_virtual_stages: int = Field(
        1,
        ge=1,
        description="Model chunks (stages) per pipeline rank: 1 for gpipe/1f1b, >=2 for "
        "interleaved-1f1b, exactly 2 for zbv/dualpipev (left unset, a V-shaped schedule "
        "implies 2).",
    )
    num_microbatches: int | None = Field(
        None,
        ge=1,
        description="Micro-batches per pipeline step. None = train.grad_accum_steps (under PP the "
        "micro-batches of one step are the gradient-accumulation steps).",
    )
    pp_first_stage_less_layers: int | None = Field(
        None,
        ge=0,
        description="Layers fewer on the first stage, to pay for the embedding. None = automatic "
        "(see pp_last_stage_less_layers).",
    )
    pp_last_stage_less_layers: int | None = Field(
        None,
        ge=0,
        description="Layers fewer on the last stage, to pay for the final norm, head and MTP "
        "modules. None = automatic: the fewest trimmed layers that split the rest evenly over "
        "pp x num_virtual_stages, the last stage trimmed at least as much as the first (61 "
        "layers on 16 stages: first 3, last 2, the others 4).",
    )

    @model_validator(mode="after")
    def _v_shape_implies_two_stages(self) -> "ParallelConfig":
        """A V-shaped schedule has exactly 2 stages per rank, so leaving the count unset means 2
        (written to __dict__ so that it stays unset: an explicit other value is still an error)."""
        if self.pp_schedule in V_SHAPED and "num_virtual_stages" not in self.model_fields_set:
            self.__dict__["num_virtual_stages"] = 2
        return self


class LossScaleConfig(Section):
    """fp16 dynamic loss scaling (ignored for fp32 and bf16)."""

    initial_scale_power: int = Field(16, ge=0, le=64, description="Start at 2**power.")
    loss_scale: float = Field(0.0, ge=0, description="Static loss scale. 0 = dynamic scaling.")
    loss_scale_window: int = Field(
        1000, ge=1, description="Steps without overflow before the scale doubles."
    )
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale halves.")
    min_loss_scale: float = Field(1.0, gt=0, description="The scale never drops below this.")


class TrainConfig(Section):
    """Batch arithmetic, length, precision and memory of one run."""

    steps: int = Field(700, gt=0, description="Optimizer steps to run.")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per rank per forward. None = inferred from global_batch_size / "
        "(grad_accum_steps x dp), as DeepSpeed does; 16 when nothing else is given.",
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step over all data-parallel ranks. None = "
        "micro_batch_size x grad_accum_steps x dp.",
    )
    grad_accum_steps: int | None = Field(
        None,
        ge=1,
        description="Micro-batches accumulated per optimizer step. None = inferred (1 when the "
        "batch sizes do not say otherwise; under PP, parallel.num_microbatches, else enough for "
        "16 sequences per data-parallel rank and at least the schedule's fewest).",
    )
    seq_len: int = Field(128, gt=0, description="Tokens per training sequence.")
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32",
        description="Compute precision: fp32 (on Ampere or newer GPUs its matmuls run as TF32, "
        "see train.tf32), bf16 autocast (master weights stay fp32), fp16 with dynamic loss "
        "scaling (see train.loss_scale), or fp8: DeepSeek-V3's fine-grained recipe (E4M3 "
        "GEMMs with 1x128 activation tiles and 128x128 weight blocks for the attention, FFN and "
        "expert linears; the rest in bf16; see train.fp8_backend). fp32 is the default so that a "
        "config computes the same on a laptop and a GPU; GPU runs warn that bf16 is what large "
        "runs use.",
    )
    fp8_backend: Literal["auto", "scaled_mm", "emulated"] = Field(
        "auto",
        description="How train.precision = fp8 runs its GEMMs. auto = scaled_mm (cuBLASLt "
        "blockwise, SM90 with CUDA >= 12.9) on a GPU that has it, the plain-torch emulation on "
        "a CPU, and an error on any other GPU; scaled_mm = required; emulated = the emulation "
        "everywhere (on a GPU with a warning: exact, but far slower than bf16).",
    )
    tf32: bool | None = Field(
        None,
        description="fp32 matmuls as TF32 on tensor cores. None = on for CUDA GPUs of compute "
        "capability 8.0 (Ampere) or newer, off elsewhere; true = required (an error where it "
        "cannot be); false = true fp32. MFU is counted against the peak of what runs.",
    )
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig)
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm. 0 = off.")
    activation_checkpoint: Literal["none", "selective", "full"] = Field(
        "none",
        description="Recompute activations in backward: none; selective (keep every matmul's and "
        "the attention kernel's output, recompute norms, activations and elementwise ops, and "
        "the routed experts: a few percent more compute, paid in both passes where zbv and "
        "dualpipev split a backward into input- and weight-gradient passes); or full (keep "
        "block inputs, recompute every block).",
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    seed: int = Field(42, ge=0, description="Seed for weights, data order and dropout.")
    deterministic: bool = Field(
        False, description="Deterministic kernels; bit-identical reruns on the same layout."
    )


class OptimConfig(Section):
    """The optimizer (AdamW by default; no weight decay on norms and biases)."""

    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(
        2e-3,
        gt=0,
        description="Peak learning rate. The default suits the tiny debug model; models of "
        "billions of parameters train at ~1e-4..4e-4.",
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay (AdamW).")
    moments: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="dtype Adam keeps its two moments in (computed in fp32 either way). auto = "
        "bf16 under train.precision = fp8 (DeepSeek-V3's low-precision optimizer states), "
        "else fp32.",
    )

    def moments_dtype(self, precision: str) -> str:
        """'fp32' or 'bf16': what `moments` means for a run in `precision`."""
        if self.moments != "auto":
            return self.moments
        return "bf16" if precision == "fp8" else "fp32"


class LRConfig(Section):
    """Learning-rate schedule: linear warmup, then a decay."""

    schedule: Literal["constant", "cosine", "linear", "wsd"] = Field(
        "cosine",
        description="After warmup: constant, cosine or linear decay to min_lr_ratio x lr, or "
        "warmup-stable-decay (wsd).",
    )
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps from warmup_start_ratio.")
    warmup_start_ratio: float = Field(
        0.0, ge=0, le=1, description="Warmup starts at this fraction of the peak lr."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak.")
    decay_steps: int | None = Field(
        None, ge=0, description="Steps of decay after warmup. None = until train.steps."
    )
    wsd_decay_ratio: float = Field(
        0.2, ge=0, le=1, description="wsd: fraction of the post-warmup steps spent decaying."
    )


class DataConfig(Section):
    """Where tokens come from."""

    source: str = Field(
        "embedded",
        description="`embedded` = a corpus built from the Python standard library's own source "
        "(no download); or a path to a .txt/.jsonl/.parquet file or directory, or a directory of "
        "tokenized shards.",
    )
    text_field: str = Field("text", description="JSONL/parquet column that holds the text.")
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="`text`: documents to continue; `chat`: instruction JSONL, each line "
        "`messages` (rendered with the tokenizer's chat template) or `prompt`/`response`, the "
        "loss on the responses only; `auto`: chat when every file is JSONL whose first record "
        "has `messages` or `prompt`, else text.",
    )
    tokenizer: str = Field(
        "bpe",
        description="`bpe`: byte-level BPE trained locally on the corpus (cached); `bytes`: raw "
        "UTF-8 bytes plus an end-of-document id (vocabulary 257); or a path to a pretrained "
        "tokenizer: a tokenizer.json, or a Hugging Face tokenizer folder (its special tokens, "
        "BOS/EOS and chat template are used). Its vocabulary must fit model.vocab_size.",
    )
    cache_dir: Path = Field(
        Path(".cache/dstrain"), description="Where tokenizers and token shards are cached."
    )
    document_mask: bool = Field(
        False,
        description="Attention stops at document boundaries (each window packs several "
        "documents, joined by EOS) and positions restart at each document; a target in another "
        "document than its position's carries no loss. Not under parallel.pp > 1 or cp > 1.",
    )
    cache_scope: Literal["shared", "node"] = Field(
        "shared",
        description="Who tokenizes into data.cache_dir: `shared` (one file system seen by every "
        "node): rank 0 alone; `node` (a node-local disk): local rank 0 of each node. The other "
        "ranks wait, then map the cached shards.",
    )


class EvalConfig(Section):
    """Validation: a held-out split, evaluated every `interval` steps and at the end."""

    fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of data.source's samples held out for validation (taken from the end "
        "of the token stream, so no training sample overlaps them). 0 = none (unless `source`).",
    )
    source: str | None = Field(
        None,
        description="Validation files of their own (tokenized as data.source is); None = the "
        "`fraction` held out of data.source.",
    )
    interval: int = Field(
        100, ge=1, description="Evaluate every N optimizer steps (and at the end)."
    )
    steps: int = Field(
        10,
        ge=0,
        description="Batches of train.global_batch_size held-out sequences per evaluation; 0 = "
        "every whole batch the split holds.",
    )


class CheckpointConfig(Section):
    """When and how state is saved (DCP, sharded)."""

    enable: bool = Field(True, description="Save checkpoints at all.")
    interval: int = Field(
        100, ge=1, description="Save a full checkpoint every N steps and at the end."
    )
    keep_last_k: int = Field(2, ge=0, description="Full checkpoints kept. 0 = keep all.")
    async_mode: Literal["disabled", "async"] = Field(
        "disabled", description="`async`: save in the background, overlapping training."
    )
    model_only_interval: int | None = Field(
        None, ge=1, description="Also save model-only checkpoints every N steps. None = off."
    )
    resume: str = Field(
        "auto",
        description="`auto`: resume from the run directory's newest valid checkpoint if any; "
        "`never`; or a checkpoint path.",
    )
    on_save_error: Literal["continue", "stop"] = Field(
        "continue",
        description="A save that fails (disk full, no permission): `continue` training (the "
        "previous valid checkpoint stays the newest) or `stop` the run with an error.",
    )
    preemption_deadline_s: float = Field(
        120.0,
        gt=0,
        description="On SIGTERM (preemption), the run saves a final checkpoint and exits; a save "
        "that would end after this many seconds from the signal is skipped.",
    )


class GuardConfig(Section):
    """The numerics guard: what a non-finite or spiking loss does to the step."""

    policy: Literal["skip", "rollback", "stop"] = Field(
        "skip",
        description="On a NaN/Inf loss or gradient norm, or a spike: `skip` the update (the "
        "batch is dropped), `rollback` to the newest checkpoint (model, optimizer, schedule; the "
        "data position moves on past the bad batch), or `stop` the run with an error.",
    )
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="A loss above this many times its running mean (EMA over recent steps) is "
        "a spike and gets the policy too. None = only non-finite values.",
    )
    spike_warmup_steps: int = Field(
        20, ge=0, description="Steps before spikes are judged (the running mean settles)."
    )
    max_consecutive: int = Field(
        5, ge=1, description="More bad steps in a row than this stop the run whatever the policy."
    )


class MetricsConfig(Section):
    """What is logged, how often, and where."""

    log_interval: int = Field(10, ge=1, description="Log metrics every N steps.")
    jsonl: bool = Field(True, description="Write runs/<name>/metrics.jsonl.")
    tensorboard: bool = Field(True, description="Write TensorBoard events to runs/<name>/tb/.")
    prometheus_port: int | None = Field(
        None, ge=1, le=65535, description="Serve Prometheus metrics on this port. None = off."
    )
    prometheus_host: str = Field("127.0.0.1", description="Address the Prometheus exporter binds.")
    wandb: bool = Field(False, description="Log to Weights & Biases in offline mode if installed.")
    timers: bool = Field(
        True,
        description="Time the phases (data, forward, backward, optimizer, checkpoint) and the "
        "collectives ranks block on (comm/exposed_fraction).",
    )
    profile_steps: str | None = Field(
        None,
        pattern=r"^[1-9][0-9]*:[1-9][0-9]*$",
        description="`A:B`: record a torch.profiler trace of steps A to B (inclusive) into "
        "runs/<name>/profile/ (one Chrome trace per rank; open in Perfetto or chrome://tracing).",
    )


class CommConfig(Section):
    """Collectives: backend, timeouts, gradient compression."""

    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="`auto`: NCCL when CUDA is available, else gloo."
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Collective timeout; a stuck rank fails the job after this."
    )
    compression: Literal["none", "bf16", "fp16", "powersgd"] = Field(
        "none",
        description="DDP gradient compression hook (zero_stage 0 only; FSDP2 cannot take hooks).",
    )
    powersgd_rank: int = Field(4, ge=1, description="PowerSGD matrix approximation rank.")
    powersgd_start_iter: int = Field(
        10, ge=2, description="PowerSGD runs plain all-reduce for the first N iterations."
    )


class ClusterConfig(Section):
    """The machines, for plan, check and deploy."""

    gpu: str | None = Field(
        None,
        description="GPU type from the hardware table (A100-80GB, H100, H800, ...; `cpu` for a "
        "CPU host). None = unknown.",
    )
    nodes: int = Field(1, ge=1, description="Nodes in the job.")
    gpus_per_node: int = Field(8, ge=1, description="Accelerators (ranks) per node.")
    network: str = Field(
        "ib-ndr", description="Inter-node network preset (ib-hdr, ib-ndr, roce-200, eth-100)."
    )
    inter_node_gbps: float | None = Field(
        None, gt=0, description="Per-GPU inter-node bandwidth in GB/s. None = the preset's."
    )


class RunConfig(Section):
    """Naming and placement of the run directory."""

    name: str = Field("default", description="Run name: the directory runs/<name>/.")
    root: Path = Field(Path("runs"), description="Folder that holds run directories.")


class DstrainConfig(Section):
    """The whole run. Sections: run, model, parallel, train, optim, lr, data, eval, checkpoint,
    guard, metrics, comm, cluster."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lr: LRConfig = Field(default_factory=LRConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)


SECTION_NAMES: tuple[str, ...] = tuple(DstrainConfig.model_fields)
