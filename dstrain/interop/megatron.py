"""Megatron-LM argument names -> dstrain config keys.

People put Megatron's parallel and batch keys beside DeepSpeed's in one JSON (the configuration
guides do), and Megatron-Core runs read the same names from YAML. Dashes and underscores are
accepted alike (`--tensor-model-parallel-size` is `tensor_model_parallel_size`).
"""

from collections.abc import Callable
from typing import Any

from dstrain.config.findings import error, info, trainer_limit
from dstrain.interop import megatron_split
from dstrain.interop.ds_keys import MEGATRON_ARGS
from dstrain.interop.imported import Imported, as_bool, as_float, as_int

# Megatron dest -> (dstrain key, kind). Kinds: int, float, bool, str.
_DIRECT: dict[str, tuple[str, str]] = {
    "tensor_model_parallel_size": ("parallel.tp", "int"),
    "pipeline_model_parallel_size": ("parallel.pp", "int"),
    "expert_model_parallel_size": ("parallel.ep", "int"),
    "context_parallel_size": ("parallel.cp", "int"),
    "sequence_parallel": ("parallel.sequence_parallel", "bool"),
    "micro_batch_size": ("train.micro_batch_size", "int"),
    "global_batch_size": ("train.global_batch_size", "int"),
    "seq_length": ("train.seq_len", "int"),
    "encoder_seq_length": ("train.seq_len", "int"),  # arguments.py copies it to seq_length
    "train_iters": ("train.steps", "int"),
    "seed": ("train.seed", "int"),
    "clip_grad": ("train.grad_clip", "float"),
    "lr": ("optim.lr", "float"),
    "weight_decay": ("optim.weight_decay", "float"),
    "adam_eps": ("optim.eps", "float"),
    "lr_warmup_iters": ("lr.warmup_steps", "int"),
    "lr_decay_iters": ("lr.decay_steps", "int"),
    "save_interval": ("checkpoint.interval", "int"),
    "log_interval": ("metrics.log_interval", "int"),
}

# Architecture keys: mapping any of them means the file names a model.
_MODEL: dict[str, tuple[str, str]] = {
    "num_layers": ("model.num_layers", "int"),
    "hidden_size": ("model.dim", "int"),
    "num_attention_heads": ("model.num_heads", "int"),
    "num_query_groups": ("model.num_kv_heads", "int"),
    "ffn_hidden_size": ("model.inter_dim", "int"),
    "max_position_embeddings": ("model.max_seq_len", "int"),
    "vocab_size": ("model.vocab_size", "int"),
    "num_experts": ("model.num_routed_experts", "int"),
    "moe_router_topk": ("model.num_activated_experts", "int"),
    "moe_ffn_hidden_size": ("model.moe_inter_dim", "int"),
    "moe_router_num_groups": ("model.n_group", "int"),
    "moe_router_group_topk": ("model.topk_group", "int"),
    "moe_router_topk_scaling_factor": ("model.route_scale", "float"),
    "moe_router_score_function": ("model.score_func", "str"),
    "moe_router_bias_update_rate": ("model.bias_update_speed", "float"),
    "moe_aux_loss_coeff": ("model.aux_loss_alpha", "float"),
    "q_lora_rank": ("model.q_lora_rank", "int"),
    "kv_lora_rank": ("model.kv_lora_rank", "int"),
    "kv_channels": ("model.head_dim", "int"),
    "pad_vocab_size_to": ("model.vocab_size", "int"),
    "qk_head_dim": ("model.qk_nope_head_dim", "int"),
    "qk_pos_emb_head_dim": ("model.qk_rope_head_dim", "int"),
    "v_head_dim": ("model.v_head_dim", "int"),
    "mtp_num_layers": ("model.num_mtp_modules", "int"),
    "mtp_loss_scaling_factor": ("model.mtp_loss_weight", "float"),
    "rotary_base": ("model.rope_theta", "float"),
    "norm_epsilon": ("model.norm_eps", "float"),
}

# Megatron-DeepSpeed (and older Megatron-LM) arguments that today's arguments.py no longer has.
_LEGACY = {
    "checkpoint_activations",
    "checkpoint_num_layers",
    "zero_stage",
    "deepspeed",
    "deepspeed_config",
    "deepspeed_activation_checkpointing",
    "train_samples",
    "lr_warmup_samples",
    "lr_decay_samples",
    "rampup_batch_size",
    "pp_partition_method",
    "data_impl",
    "DDP_impl",
    "distributed_backend",
    "partition_activations",
    "contigious_checkpointing",
    "synchronize_each_layer",
    "embed_layernorm",
    "kill_switch_path",
    "train_weighted_split_paths_path",
    "valid_weighted_split_paths_path",
    "tokenizer_type",
    "tokenizer_name_or_path",
    "abort_on_unmet_fused_kernel_constraints",
    "position_embedding_type",
    "log_batch_size_to_tensorboard",
    "log_validation_ppl_to_tensorboard",
    "tensorboard_queue_size",
    "log_timers_to_tensorboard",
    "exit_duration_in_mins",
    "init_method_std",
    "optimizer",
    "valid_num_workers",
    "num_workers",
    "split",
    "vocab_file",
    "merge_file",
    "data_path",
    "save",
    "load",
    "eval_interval",
    "eval_iters",
    "tensorboard_dir",
    "seq_parallel",
}

_SPECIAL = (
    "checkpoint_activations",
    "zero_stage",
    "train_samples",
    "lr_warmup_samples",
    "lr_decay_samples",
    "pp_partition_method",
    "multi_latent_attention",
    "swiglu",
    "num_layers_per_virtual_pipeline_stage",
    "virtual_pipeline_model_parallel_size",
    "num_virtual_stages_per_pipeline_rank",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "bf16",
    "fp16",
    "use_distributed_optimizer",
    "recompute_granularity",
    "lr_decay_style",
    "adam_beta1",
    "adam_beta2",
    "min_lr",
    "lr_warmup_fraction",
)


def normalize(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def known_keys() -> set[str]:
    return set(MEGATRON_ARGS) | set(_DIRECT) | set(_MODEL) | set(_SPECIAL) | _LEGACY


def is_megatron_key(key: str) -> bool:
    return normalize(key) in known_keys()


def import_flags(flags: dict[str, Any], engine: str) -> Imported:
    """A launch's Megatron flags as a dstrain config, judged by `engine`'s rules alone (no
    DeepSpeed config is involved)."""
    out = Imported(engine=engine)
    map_keys({k: v for k, v in flags.items() if is_megatron_key(k)}, out)
    finish(out)
    return out


def map_keys(items: dict[str, Any], out: Imported) -> None:
    """Map Megatron keys into `out`; the ones that depend on others (min_lr on lr) go last."""
    ordered = sorted(items.items(), key=lambda item: normalize(item[0]) in _SPECIAL)
    for key, value in ordered:
        map_key(key, value, out)


def map_key(key: str, value: Any, out: Imported) -> None:
    """Map one Megatron key into `out`, or report it as having no effect."""
    name = normalize(key)
    out.current = key
    if name in _DIRECT or name in _MODEL:
        target, kind = _DIRECT.get(name) or _MODEL[name]
        converted = _CONVERT[kind](value, key, out)
        if converted is not None:
            out.set(target, converted)
    elif name in _SPECIAL:
        _map_special(name, key, value, out)
    else:
        out.findings.append(info(key, "Megatron-LM argument with no dstrain equivalent: no effect"))


def _map_special(name: str, key: str, value: Any, out: Imported) -> None:
    if name in ("train_samples", "lr_warmup_samples", "lr_decay_samples"):
        samples = as_int(value, key, out.findings, minimum=0)
        if samples is not None:
            out.samples[name] = samples  # steps once the global batch is known (`finish`)
    elif name == "checkpoint_activations" and as_bool(value, key, out.findings):
        out.set("train.activation_checkpoint", "full")
    elif name == "zero_stage" and (stage := as_int(value, key, out.findings)) is not None:
        out.set("parallel.zero_stage", min(stage, 3))
    elif name == "pp_partition_method" and "embed" in str(value):
        # Megatron-DeepSpeed's type-based split counts the embedding (first stage) and the tied
        # output embedding (last stage) as layers.
        out.set("parallel.pp_first_stage_less_layers", 1)
        out.set("parallel.pp_last_stage_less_layers", 1)
    elif name == "swiglu" and as_bool(value, key, out.findings):
        out.set("model.mlp", "swiglu")
    elif name == "multi_latent_attention" and as_bool(value, key, out.findings):
        out.set("model.attention", "mla")
    elif name == "num_layers_per_virtual_pipeline_stage":
        out.virtual_layers_per_stage = as_int(value, key, out.findings, minimum=1)
        out.stage_layers[name] = out.virtual_layers_per_stage  # with the layers (`finish`)
        out.set("parallel.pp_schedule", "interleaved-1f1b")
    elif name in ("virtual_pipeline_model_parallel_size", "num_virtual_stages_per_pipeline_rank"):
        # Megatron-LM's schedule follows from the count: more than one model chunk per pipeline
        # rank is the interleaved 1F1B (megatron/core/pipeline_parallel/schedules.py,
        # get_forward_backward_func: forward_backward_pipelining_with_interleaving).
        chunks = as_int(value, key, out.findings, minimum=1)
        if chunks is not None:
            out.stage_layers[name] = chunks  # the layer split (`finish`)
            out.set("parallel.num_virtual_stages", chunks)
            if chunks > 1:
                out.set("parallel.pp_schedule", "interleaved-1f1b")
    elif name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if (count := as_int(value, key, out.findings)) is not None:
            out.stage_layers[name] = count  # resolved once layers and pp are known (`finish`)
    elif name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        out.stage_layers[name] = as_bool(value, key, out.findings)
    elif name in ("bf16", "fp16") and as_bool(value, key, out.findings):
        if out.data.get("train", {}).get("precision") in ("bf16", "fp16"):
            # megatron/training/arguments.py, validate_args: `assert not args.fp16` under
            # args.bf16 ("cannot use both fp16 and bf16").
            out.findings.append(
                error(
                    key,
                    "--fp16 and --bf16 are both given: Megatron-LM asserts that only one is set",
                    "keep one of --fp16 / --bf16",
                )
            )
        out.set("train.precision", name)
    elif name == "use_distributed_optimizer" and as_bool(value, key, out.findings):
        out.set("parallel.zero_stage", 1)
    elif name == "recompute_granularity" and value in ("full", "selective"):
        out.set("train.activation_checkpoint", value)
    elif name == "lr_decay_style":
        styles = {"cosine": "cosine", "linear": "linear", "constant": "constant", "WSD": "wsd"}
        if value in styles:
            out.set("lr.schedule", styles[value])
        else:
            out.findings.append(info(key, f"decay style {value!r} has no dstrain equivalent"))
    elif name in ("adam_beta1", "adam_beta2") and (beta := as_float(value, key, out.findings)):
        betas = list(out.data.get("optim", {}).get("betas", [0.9, 0.95]))
        betas[name == "adam_beta2"] = beta
        out.set("optim.betas", betas)
    elif name == "lr_warmup_fraction" and (share := as_float(value, key, out.findings)):
        out.samples["lr_warmup_fraction"] = share  # of the decay iterations (`finish`)
    elif name == "min_lr" and (floor := as_float(value, key, out.findings)) is not None:
        peak = out.data.get("optim", {}).get("lr")
        if peak:
            out.set("lr.min_lr_ratio", min(1.0, floor / peak))
        else:
            out.findings.append(info(key, "min_lr needs lr beside it to become lr.min_lr_ratio"))


def finish(out: Imported) -> None:
    """What Megatron implies once every key is in: steps from sample counts, and the rest of the
    architecture (Megatron's defaults) when the file describes a model."""
    _samples_to_steps(out)
    _warmup(out)
    _stage_layers(out)
    # A model is described when Megatron's required shape arguments are (arguments.py asserts
    # num_layers, hidden_size and num_attention_heads are not None): a tuning key alone (the
    # aux-loss weight) does not make the rest of the architecture Megatron's defaults.
    model = out.data.get("model", {})
    out.model_given = all(k in model for k in ("num_layers", "dim", "num_heads"))
    if not out.model_given and model:
        out.findings.append(
            info(
                "model",
                "the architecture is only partly given (Megatron needs --num-layers, "
                "--hidden-size and --num-attention-heads; a wrapper may read them from a "
                "checkpoint's config): model-shape checks are skipped",
            )
        )
        out.data.pop("model")
    if out.model_given:
        _implied_architecture(out)


def _warmup(out: Imported) -> None:
    """Megatron's warmup: --lr-warmup-fraction of the decay iterations (megatron/training/
    training.py, get_optimizer_param_scheduler: lr_warmup_steps = lr_warmup_fraction *
    lr_decay_steps, the decay defaulting to train_iters), and none when neither is given (its
    default lr_warmup_iters = 0), not dstrain's own default."""
    share = out.samples.pop("lr_warmup_fraction", None)
    if not out.engine.startswith("Megatron") and share is None:
        return
    if "warmup_steps" in out.data.get("lr", {}):
        return
    decay = out.data.get("lr", {}).get("decay_steps") or out.data.get("train", {}).get("steps")
    if share is not None and decay:
        out.set("lr.warmup_steps", int(share * decay), "lr_warmup_fraction")
    elif out.engine.startswith("Megatron"):
        out.set("lr.warmup_steps", 0, "lr_warmup_iters")


def _stage_layers(out: Imported) -> None:
    """Megatron-Core's split of the layers over the pipeline ranks and their virtual stages
    (megatron_split.pipeline_split), checked as soon as --num-layers and the pipeline size are
    given, whatever else of the architecture the script leaves out, and kept as dstrain's
    per-end trims. Megatron-DeepSpeed's pipeline is DeepSpeed's PipelineModule, which balances
    layers by parameter count (partition_method "parameters", deepspeed/runtime/pipe/module.py)
    and so accepts any count: there dstrain's automatic trimming stands."""
    split = out.stage_layers
    pp = out.data.get("parallel", {}).get("pp", 1)
    layers = out.data.get("model", {}).get("num_layers")
    if out.engine == "Megatron-DeepSpeed" or pp < 2:
        return
    if not isinstance(layers, int):
        if (
            "decoder_first_pipeline_num_layers" in split
            or "decoder_last_pipeline_num_layers" in split
        ):
            out.findings.append(
                info(
                    "decoder_first_pipeline_num_layers",
                    "needs --num-layers beside it to become per-stage trims",
                )
            )
        _set_trims(out, 0, 0, out.origins.get("parallel.pp"))  # Megatron's even split
        return
    chunks, vp, found = megatron_split.pipeline_split(layers, pp, split)
    out.findings.extend(found)
    if "num_layers_per_virtual_pipeline_stage" in split:
        out.virtual_layers_per_stage = None  # resolved here, with the embedding/loss counted
        if chunks is not None:
            out.set("parallel.num_virtual_stages", vp, "num_layers_per_virtual_pipeline_stage")
        else:  # refused above: no virtual size to run the interleaved schedule with
            out.set("parallel.pp_schedule", "1f1b", "num_layers_per_virtual_pipeline_stage")
    if chunks is None:
        # Refused above, once: dstrain's automatic trims stand in, so that its own layer rule
        # does not report the same split a second time.
        _set_trims(out, None, None, out.origins.get("parallel.pp"))
        return
    _chunks_as_trims(out, chunks, split)


def _chunks_as_trims(out: Imported, chunks: list[int], split: dict[str, Any]) -> None:
    """dstrain's split: every virtual stage holds the same layers except the first and the
    last, which may hold fewer. Megatron's uneven first/last *rank* under a virtual size puts
    its count on every chunk of that rank, which dstrain cannot lay out."""
    middle = chunks[1:-1] or [max(chunks)]
    share = max(middle)
    first, last = share - chunks[0], share - chunks[-1]
    given = [k for k in split if k.startswith(("decoder_", "account_for_"))]
    source = given[0] if given else out.origins.get("parallel.pp")
    if len(set(middle)) > 1 or first < 0 or last < 0:
        out.findings.append(
            trainer_limit(
                source or "pipeline_model_parallel_size",
                f"Megatron-Core builds {chunks} layers on its {len(chunks)} virtual stages; "
                "dstrain's split holds the same count on every stage but the first and the last, "
                "which may hold fewer",
                "give the end stages at most as many layers as the others, and under a virtual "
                "size as many as the middle ranks",
            )
        )
        return
    _set_trims(out, first, last, source)


def _set_trims(out: Imported, first: int | None, last: int | None, source: str | None) -> None:
    parallel = out.data.get("parallel", {})
    for end, count in (("first", first), ("last", last)):
        if f"pp_{end}_stage_less_layers" not in parallel or count is None:
            out.set(f"parallel.pp_{end}_stage_less_layers", count, source)


def _samples_to_steps(out: Imported) -> None:
    batch = out.data.get("train", {}).get("global_batch_size")
    targets = {
        "train_samples": "train.steps",
        "lr_warmup_samples": "lr.warmup_steps",
        "lr_decay_samples": "lr.decay_steps",
    }
    for name, samples in out.samples.items():
        if name not in targets:  # lr_warmup_fraction: `_warmup`
            continue
        if batch:
            out.set(
                targets[name],
                max(1, samples // batch) if name == "train_samples" else samples // batch,
                name,
            )
        else:
            out.findings.append(info(name, "needs global_batch_size beside it to become steps"))


def _implied_architecture(out: Imported) -> None:
    """Megatron's defaults for what the file leaves out: a dense multi-head GPT unless experts or
    MLA are named, a 4x FFN, and a vocabulary padded to 128 x tp as Megatron pads it."""
    model = out.data.setdefault("model", {})
    tp = out.data.get("parallel", {}).get("tp", 1)
    layers = model.get("num_layers", 24)
    dim = model.get("dim", 1024)
    experts = model.get("num_routed_experts", 0)
    implied = {
        "attention": "mha",
        "mlp": "gelu",  # Megatron's default without --swiglu
        "num_routed_experts": 0,
        "num_shared_experts": 0,
        "num_activated_experts": min(2, experts),
        "first_k_dense": 0 if experts else layers,
        "n_group": 1,
        "topk_group": 1,
        # arguments.py: ffn_hidden_size defaults to 4h, with --swiglu to int(8h/3 / 64) * 64.
        "inter_dim": int(4 * dim * 2 / 3 / 64) * 64 if model.get("mlp") == "swiglu" else 4 * dim,
        "num_mtp_modules": 0,
        "max_seq_len": out.data.get("train", {}).get("seq_len", 2048),
        "vocab_size": _padded(50257, 128 * tp),
    }
    for name, value in implied.items():
        model.setdefault(name, value)
    if normalize(out.origins.get("model.vocab_size", "")) == "vocab_size":
        model["vocab_size"] = _padded(model["vocab_size"], 128 * tp)  # as Megatron pads it


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _to_int(value: Any, key: str, out: Imported) -> int | None:
    return as_int(value, key, out.findings, minimum=0)


def _to_float(value: Any, key: str, out: Imported) -> float | None:
    return as_float(value, key, out.findings)


def _to_bool(value: Any, key: str, out: Imported) -> bool | None:
    return as_bool(value, key, out.findings)


def _to_str(value: Any, key: str, out: Imported) -> str:
    return str(value)


_CONVERT: dict[str, Callable[[Any, str, Imported], Any]] = {
    "int": _to_int,
    "float": _to_float,
    "bool": _to_bool,
    "str": _to_str,
}
