"""Catalogue of the keys DeepSpeed's JSON config and Megatron-LM's arguments accept.

Sources:
  DeepSpeed, read as released source (PyPI sdists deepspeed-0.19.8 and deepspeed-0.18.9):
    deepspeed/runtime/{config,constants,config_utils,precision_config,lr_schedules,engine}.py,
    runtime/zero/{config,offload_config,leaf_module_config}.py, runtime/zenflow/zenflow_config.py,
    runtime/activation_checkpointing/config.py, runtime/tensor_parallel/config.py,
    runtime/swap_tensor/{constants,aio_config}.py, runtime/model_checkpointing/constants.py,
    runtime/data_pipeline/{constants,config,curriculum_scheduler}.py, runtime/pipe/engine.py,
    runtime/fp16/onebit/{adam,zoadam,lamb}.py (0.18.9), monitor/config.py, comm/config.py,
    profiling/{config,constants}.py, autotuning/{config,constants}.py, compile/config.py,
    utils/config.py, datastates/config.py, module_inject/auto_ep_config.py,
    elasticity/constants.py and nebula/constants.py (0.18.9), ops/{adam,lamb,lion,adagrad}/*.py.
  deepspeedai/DeepSpeed main (search index): runtime/config.py @029f12b3,
    runtime/constants.py @ac2f3a34, runtime/zero/config.py @1b88ac36,
    runtime/zero/offload_config.py @1978617c, runtime/precision_config.py @0ac46845,
    monitor/config.py @bce0585b, docs/_pages/config-json.md @00376da4.
  microsoft/DeepSpeed history: runtime/zero/constants.py @02a63e43 (cpu_offload_params,
    allgather_size), zero/offload_constants.py @077e6740, runtime/activation_checkpointing/
    config.py @077e6740, comm/config.py @01c61b8c, profiling/config.py @0cdce824,
    elasticity/constants.py @01ee3a4f, and older runtime/constants.py (fp32_allreduce)
    and swap_tensor/constants.py (aio.thread_count).
  NVIDIA/Megatron-LM megatron/training/arguments.py @000c4ac2 (2025, core_r0.14+ era): every
    add_argument dest.
  mup 1.0.0 (PyPI) optim.py for MuAdam/MuAdamW/MuSGD; torch.optim signatures for pass-through
    optimizers are from the torch 2.x documentation.

Notes:
  * DeepSpeed 0.19 removed several features and now rejects their top-level keys with a
    DeepSpeedConfigError (https://github.com/deepspeedai/DeepSpeed/issues/8489): amp,
    sparse_gradients, graph_harvesting, compression_training, quantize_training, eigenvalue,
    sparse_attention, progressive_layer_drop, curriculum_learning (legacy top level), elasticity,
    nebula, and zero_optimization.{mics_shard_size, mics_hierarchical_params_gather,
    zeropp_loco_param}. They are kept below as legacy keys (valid up to 0.18.x), marked so.
  * Pydantic sections (zero_optimization and its offload/zenflow/leaf_module children, fp16, bf16,
    tensorboard/wandb/csv_monitor/comet, comms_logger, compile, timers.throughput,
    hybrid_engine, tensor_parallel) use extra="forbid" and populate_by_name=True, so both a
    field name and its alias (e.g. max_live_parameters / stage3_max_live_parameters) are valid
    and anything else is an error. The other sections are read with dict.get(), so DeepSpeed
    silently ignores unknown keys there; a misspelling is still a bug worth reporting.
  * DeepSpeed lowercases optimizer.type only for its own optimizers; any other type is looked up
    verbatim as torch.optim.<type> (so "SGD", not "sgd", at run time).
"""

import os
import re
from dataclasses import dataclass

from dstrain.errors import UserError

# fmt: off

# Every top-level key DeepSpeed's config accepts (DeepSpeedConfig and the section parsers).
DS_TOP_LEVEL: frozenset[str] = frozenset({
    # batch size, logging and run control
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation",  # 0.19+
    "steps_per_print", "dump_state", "wall_clock_breakdown", "memory_breakdown",
    "disable_python_gc", "log_level",  # 0.19+
    "dataloader_drop_last", "vocabulary_size",
    "sequence_parallel_size",  # read by DeepSpeedConfig to size the DP world (HF zero.Init)
    # communication
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "disable_allgather", "use_data_before_expert_parallelism",
    "gradient_allreduce_op",  # 0.19+
    # precision
    "fp16", "bf16", "torch_autocast", "gradient_clipping", "data_types",
    # optimizer, scheduler, ZeRO
    "optimizer", "scheduler", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    # parallelism and runtime features
    "activation_checkpointing", "pipeline", "tensor_parallel", "hybrid_engine", "compile",
    "aio", "checkpoint", "datastates_ckpt", "weight_quantization", "data_efficiency", "timers",
    "expert_parallel",  # 0.19+ (AutoEP)
    # monitoring, profiling, autotuning
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler",
    "autotuning",
    "trackio",  # main, after 0.19.8
    # legacy: accepted up to 0.18.x, rejected by 0.19+ (removed features, issue #8489)
    "amp", "sparse_gradients", "graph_harvesting", "compression_training", "quantize_training",
    "sparse_attention", "progressive_layer_drop", "elasticity", "nebula",
    # legacy; 0.19 points to data_efficiency.data_sampling.curriculum_learning instead
    "curriculum_learning",
    "eigenvalue",  # read at top level by old releases; 0.7-0.18 read it inside quantize_training
})

# Keys accepted inside each section, by dotted path of the section.
DS_SECTION_KEYS: dict[str, frozenset[str]] = {
    "zero_optimization": frozenset({
        "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
        "overlap_comm", "load_from_fp32_weights", "offload_param", "offload_optimizer",
        "zenflow", "sub_group_size", "ignore_unused_parameters", "round_robin_gradients",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint",
        "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory", "leaf_module",
        "elastic_checkpoint",  # documented as deprecated for ZeRO-3; still a field
        # field name / "stage3_" alias pairs (populate_by_name: both spellings are valid)
        "prefetch_bucket_size", "stage3_prefetch_bucket_size",
        "param_persistence_threshold", "stage3_param_persistence_threshold",
        "model_persistence_threshold", "stage3_model_persistence_threshold",
        "max_live_parameters", "stage3_max_live_parameters",
        "max_reuse_distance", "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold", "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential", "stage3_allgather_sequential",
        "partition_stream_chunk_size", "stage3_partition_stream_chunk_size",  # main
        "compute_grad_norm", "parameter_alignment",  # 0.19+
        "mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param",  # <= 0.18
    }),
    "zero_optimization.offload_param": frozenset({
        "device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory",
    }),
    "zero_optimization.offload_optimizer": frozenset({
        "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
        "fast_init", "ratio", "super_offload", "cpuadam_cores_perc",
        "convert_grad_on_cpu",  # main
    }),
    "zero_optimization.zenflow": frozenset({
        "topk_ratio", "select_strategy", "select_interval", "update_interval", "overlap_step",
        "offload", "auto_ratio", "full_warm_up_rounds", "pt_reserved_cores_perc",
        "steps_per_epoch",
    }),
    "zero_optimization.leaf_module": frozenset({"classes", "names", "name_suffixes"}),
    "fp16": frozenset({
        "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
        "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
    }),
    # DeepSpeedBF16Config: no loss-scaling keys.
    "bf16": frozenset({
        "enabled", "immediate_grad_update", "check_grad_overflow",
        "bf16_master_weights_and_grads", "bf16_optimizer_states",
    }),
    # legacy (<= 0.18): everything but "enabled" goes to apex amp.initialize(**kwargs)
    "amp": frozenset({
        "enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
        "master_weights", "loss_scale", "cast_model_outputs", "num_losses", "verbosity",
        "min_loss_scale", "max_loss_scale",
    }),
    "torch_autocast": frozenset({"enabled", "dtype", "lower_precision_safe_modules"}),
    "data_types": frozenset({
        "grad_accum_dtype",
        "param_dtype", "buffer_dtype", "keep_in_fp32_modules",  # 0.19+
    }),
    "activation_checkpointing": frozenset({
        "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile",
    }),
    "tensorboard": frozenset({"enabled", "output_path", "job_name"}),
    "csv_monitor": frozenset({"enabled", "output_path", "job_name"}),
    "wandb": frozenset({"enabled", "group", "team", "project"}),
    "comet": frozenset({
        "enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
        "experiment_key", "online", "mode",
    }),
    "trackio": frozenset({"enabled", "project"}),  # main
    "flops_profiler": frozenset({
        "enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules",
        "detailed", "output_file",
    }),
    "comms_logger": frozenset({"enabled", "prof_all", "prof_ops", "verbose", "debug"}),
    # params are checked against DS_OPTIMIZER_PARAMS / DS_SCHEDULER_PARAMS
    "optimizer": frozenset({"type", "params", "legacy_fusion"}),
    "scheduler": frozenset({"type", "params"}),
    # get_pipeline_config copies any key; these are the ones the pipeline engine reads
    "pipeline": frozenset({
        "stages", "partition", "seed_layers", "activation_checkpoint_interval",
        "pipe_partitioned", "grad_partitioned", "use_reentrant",
    }),
    "tensor_parallel": frozenset({
        "autotp_size", "dtype", "tp_overlap_comm", "partition_config", "preset_model",
        "keep_module_on_host", "injection_policy_tuple",
        "tensor_parallel", "tp",  # field / alias
        "replace_with_kernel_inject", "kernel_inject",  # field / alias
        "vocab_parallel_lm_head", "vocab_parallel_ce_backend",  # 0.19+
    }),
    "tensor_parallel.tp": frozenset({"tp_size", "tp_grain_size", "mpu", "tp_group"}),
    "tensor_parallel.tensor_parallel": frozenset({"tp_size", "tp_grain_size", "mpu", "tp_group"}),
    # 0.19+ AutoEP (module_inject/auto_ep_config.py parse_autoep_config)
    "expert_parallel": frozenset({
        "enabled", "autoep_size", "expert_tensor_parallel_size", "validate_folding_routing",
        "async_split_plan", "preset_model", "moe_layer_pattern", "expert_pattern",
        "router_pattern", "use_grouped_mm", "disable_triton_grouped_mm", "route_norm",
        "route_scale", "score_apply", "combine_impl", "row_weighting_impl", "gate_up_impl",
        "comm_backend", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank",
        "num_expert_groups", "num_limited_groups", "score_func", "top_k", "load_balance_coeff",
        "routed_scaling_factor", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr",
        "top_k_attr", "has_shared_experts", "shared_experts_pattern",
        "shared_experts_gate_pattern", "expert_activation",
    }),
    # legacy (<= 0.18)
    "elasticity": frozenset({
        "enabled", "max_train_batch_size", "micro_batch_sizes", "min_gpus", "max_gpus",
        "min_time", "prefer_larger_batch", "ignore_non_elastic_batch_info", "version",
        "model_parallel_size", "num_gpus_per_node",
    }),
    "aio": frozenset({
        "block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events",
        "use_gds",
    }),
    "checkpoint": frozenset({
        "tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
        "checkpoint_serialization", "writer",
    }),
    "checkpoint.parallel_write": frozenset({"pipeline_stage"}),
    "checkpoint.writer": frozenset({
        "type", "decoupled", "io_buffer_size", "io_buffer_double", "show_statistics",
        "data_parallel", "io_multiplier",
    }),
    "compile": frozenset({
        "deepcompile", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
        "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
        "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes",
        "autoep_non_moe", "offload_activation_pin_memory",  # 0.19+
    }),
    "autotuning": frozenset({
        "enabled", "fast", "results_dir", "exps_dir", "overwrite", "start_profile_step",
        "end_profile_step", "metric", "metric_path", "tuner_type", "tuner_early_stopping",
        "tuner_num_trials", "arg_mappings", "model_info", "model_info_path", "mp_size",
        "max_train_batch_size", "min_train_batch_size", "max_train_micro_batch_size_per_gpu",
        "min_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes",
    }),
    "autotuning.model_info": frozenset({"profile", "num_params", "hidden_size", "num_layers"}),
    # legacy (<= 0.18)
    "nebula": frozenset({
        "enabled", "persistent_storage_path", "persistent_time_interval",
        "num_of_version_in_retention", "enable_nebula_load", "nebula_load_path",
    }),
    # legacy top-level curriculum learning (<= 0.18), read by CurriculumScheduler and the engine
    "curriculum_learning": frozenset({
        "enabled", "curriculum_type", "min_difficulty", "max_difficulty", "schedule_type",
        "schedule_config",
    }),
    # top-level children only; data_sampling / data_routing are opaque
    "data_efficiency": frozenset({"enabled", "seed", "data_sampling", "data_routing"}),
    # legacy (<= 0.18)
    "sparse_attention": frozenset({
        "mode", "block", "different_layout_per_head", "num_local_blocks", "num_global_blocks",
        "attention", "horizontal_global_attention", "num_different_global_patterns",
        "num_random_blocks", "local_window_blocks", "global_block_indices",
        "global_block_end_indices", "num_sliding_window_blocks",
    }),
    "hybrid_engine": frozenset({
        "enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
        "pin_parameters", "tp_gather_partition_size",
        "enable_cuda_graph",  # 0.19+
    }),
    "timers": frozenset({"throughput"}),
    "timers.throughput": frozenset({"enabled", "synchronized"}),
    # legacy (<= 0.18)
    "eigenvalue": frozenset({
        "enabled", "verbose", "max_iter", "tol", "stability", "gas_boundary_resolution",
        "layer_name", "layer_num",
    }),
    # legacy (<= 0.18)
    "progressive_layer_drop": frozenset({"enabled", "theta", "gamma"}),
}

# Sections whose inside we do not validate (deep or free-form trees).
DS_OPAQUE_SECTIONS: frozenset[str] = frozenset({
    "compression_training",  # legacy (<= 0.18), deep per-technique tree
    "quantize_training",  # legacy (<= 0.18) MoQ, holds its own eigenvalue block
    "weight_quantization",  # inference WeightQuantConfig
    "datastates_ckpt",  # passed through verbatim to the DataStates engine
    "data_efficiency.data_sampling", "data_efficiency.data_routing",
    "curriculum_learning.schedule_config",  # keys depend on schedule_type
    "autotuning.arg_mappings",  # maps DeepSpeed keys to user script arguments
    "tensor_parallel.partition_config",  # AutoTP layer_specs tree
    "zero_optimization.zeropp_loco_param",  # Dict[str, Any] (err_beta, reset_T), <= 0.18
})

# Deprecated or renamed keys that DeepSpeed still accepts (dotted path -> dotted replacement path,
# or a short explanation string starting with "use ").
DS_DEPRECATED: dict[str, str] = {
    "bfloat16": "bf16",  # BFLOAT16_OLD, read when "bf16" is absent
    # DeepSpeedZeroConfig fields with json_schema_extra={"deprecated": True, "new_param": ...}
    "zero_optimization.cpu_offload": "zero_optimization.offload_optimizer.device",
    "zero_optimization.cpu_offload_param": "zero_optimization.offload_param.device",
    # new_param "offload_param or offload_optimizer"
    "zero_optimization.cpu_offload_use_pin_memory":
        "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    # pre-pydantic spelling (zero/constants.py ZERO_OPTIMIZATION_CPU_OFFLOAD_PARAMS)
    "zero_optimization.cpu_offload_params": "zero_optimization.offload_param.device",
    "zero_optimization.legacy_stage1":
        "use zero_optimization.stage (legacy_stage1=true raises since DeepSpeed 0.5.9)",
    # read from the top level when "zero_optimization" is given as a bare bool (deprecated form)
    "allgather_size": "zero_optimization.allgather_bucket_size",
    "fp32_allreduce": 'use communication_data_type: "fp32"',  # pre-0.6 constants.py
    "seq_parallel_comm_data_type": "seq_parallel_communication_data_type",  # older constants.py
    "aio.thread_count": "aio.intra_op_parallelism",  # renamed in swap_tensor/constants.py
}

# Accepted constructor params per optimizer type (lowercased type names). DeepSpeed's own types
# union every backend the engine may build for them; torch pass-through types list the
# torch.optim signature.
DS_OPTIMIZER_PARAMS: dict[str, frozenset[str]] = {
    # FusedAdam | DeepSpeedCPUAdam | torch.optim.Adam (torch_adam=true, adam_w_mode=false);
    # torch_adam, adam_w_mode, fp32_optimizer_states are popped by the engine.
    "adam": frozenset({
        "lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "torch_adam",
        "adam_w_mode", "set_grad_none", "fp32_optimizer_states", "foreach", "maximize",
        "capturable", "differentiable", "fused", "decoupled_weight_decay",
    }),
    # FusedAdam | DeepSpeedCPUAdam | torch.optim.AdamW
    "adamw": frozenset({
        "lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "torch_adam",
        "adam_w_mode", "set_grad_none", "fp32_optimizer_states", "foreach", "maximize",
        "capturable", "differentiable", "fused",
    }),
    # ops/lamb/fused_lamb.py FusedLamb (max_grad_norm is rejected before construction)
    "lamb": frozenset({
        "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_coeff",
        "min_coeff", "amsgrad",
    }),
    # runtime/fp16/onebit/*.py, <= 0.18 (the 1-bit optimizers are gone in 0.19)
    "onebitadam": frozenset({
        "lr", "freeze_step", "bias_correction", "betas", "eps", "eps_inside_sqrt",
        "weight_decay", "amsgrad", "cuda_aware", "comm_backend_name",
    }),
    "zerooneadam": frozenset({
        "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay",
        "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
        "amsgrad", "cuda_aware", "comm_backend_name",
    }),
    "onebitlamb": frozenset({
        "lr", "freeze_step", "bias_correction", "betas", "eps", "eps_inside_sqrt",
        "weight_decay", "max_coeff", "min_coeff", "amsgrad", "cuda_aware", "comm_backend_name",
        "coeff_beta", "factor_max", "factor_min", "factor_threshold",
    }),
    # FusedLion | DeepSpeedCPULion
    "lion": frozenset({"lr", "betas", "weight_decay", "set_grad_none", "fp32_optimizer_states"}),
    # DeepSpeedCPUAdagrad (ZeRO offload) | torch.optim.Adagrad
    "adagrad": frozenset({
        "lr", "eps", "weight_decay", "amsgrad", "fp32_optimizer_states", "lr_decay",
        "initial_accumulator_value", "foreach", "maximize", "differentiable", "fused",
    }),
    # MuonWithAuxAdam: Muon half takes lr/momentum/weight_decay/ns_method, Adam half takes
    # lr/betas/eps/weight_decay; muon_lr / adam_lr override lr per half.
    "muon": frozenset({
        "lr", "momentum", "weight_decay", "ns_method", "betas", "eps", "muon_lr", "adam_lr",
        "torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach",
        "per_head_muon",  # main (config-json.md)
    }),
    # mup 1.0.0: MuAdam(params, impl=Adam, **kwargs), MuAdamW -> AdamW, MuSGD(impl=SGD)
    "muadam": frozenset({
        "lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
        "differentiable", "fused", "decoupled_weight_decay",
    }),
    "muadamw": frozenset({
        "lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
        "differentiable", "fused",
    }),
    "musgd": frozenset({
        "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
        "differentiable", "fused",
    }),
    # torch.optim pass-through (type must be spelled as the torch class, e.g. "SGD")
    "sgd": frozenset({
        "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
        "differentiable", "fused",
    }),
    "rmsprop": frozenset({
        "lr", "alpha", "eps", "weight_decay", "momentum", "centered", "capturable", "foreach",
        "maximize", "differentiable",
    }),
    "adadelta": frozenset({
        "lr", "rho", "eps", "weight_decay", "foreach", "capturable", "maximize",
        "differentiable",
    }),
    "adamax": frozenset({
        "lr", "betas", "eps", "weight_decay", "foreach", "maximize", "differentiable",
        "capturable",
    }),
    "nadam": frozenset({
        "lr", "betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay",
        "foreach", "maximize", "capturable", "differentiable",
    }),
    "radam": frozenset({
        "lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "foreach", "maximize",
        "capturable", "differentiable",
    }),
}

# Optimizer params DeepSpeed rejects explicitly with its own message (param -> the replacement).
DS_REJECTED_OPTIMIZER_PARAMS: dict[str, str] = {
    # engine._configure_basic_optimizer: ValueError "'max_grad_norm' is not supported as an
    # optimizer parameter, please switch to using the deepspeed parameter 'gradient_clipping'"
    "max_grad_norm": "use the top-level `gradient_clipping` key",
}

# Accepted params per scheduler type (runtime/lr_schedules.py constructors, optimizer excluded).
DS_SCHEDULER_PARAMS: dict[str, frozenset[str]] = {
    "LRRangeTest": frozenset({
        "lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
        "lr_range_test_staircase", "last_batch_iteration",
    }),
    "OneCycle": frozenset({
        "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
        "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
        "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate",
        "last_batch_iteration",
    }),
    "WarmupLR": frozenset({
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
        "last_batch_iteration",
    }),
    "WarmupDecayLR": frozenset({
        "total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
        "last_batch_iteration",
    }),
    "WarmupCosineLR": frozenset({
        "total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
        "warmup_type", "last_batch_iteration",
    }),
}

# Every Megatron-LM argparse dest (underscore form), all of them from arguments.py. A dest can
# differ from its flag: --no-fp8-wgrad -> fp8_wgrad, --fp8-format -> fp8,
# --inference-max-requests -> inference_max_batch_size, --use-nccl-ub -> nccl_ub.
MEGATRON_ARGS: frozenset[str] = frozenset({
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "accumulate_allreduce_grads_in_fp32", "activation_func_clamp_value", "adam_beta1", "adam_beta2",
    "adam_eps", "add_bias_linear", "add_position_embedding", "add_qkv_bias", "adlr_autoresume",
    "adlr_autoresume_interval", "align_grad_reduce", "align_param_gather",
    "allow_ambiguous_pad_tokens", "app_tag_run_name", "app_tag_run_version", "apply_layernorm_1p",
    "apply_query_key_layer_scaling", "apply_residual_connection_post_layernorm",
    "apply_rope_fusion", "async_save", "async_tensor_model_parallel_allreduce", "attention_backend",
    "attention_dropout", "attention_softmax_in_fp32", "auto_detect_ckpt_format",
    "barrier_with_L1_time", "batch_size", "bert_binary_head", "bert_embedder_type", "bert_load",
    "bf16", "bias_dropout_fusion", "bias_gelu_fusion", "bias_swiglu_fusion",
    "biencoder_projection_dim", "biencoder_shared_query_context_model", "block_data_path",
    "cache_mla_latents", "calc_ft_timeouts", "calculate_per_token_loss", "check_for_large_grads",
    "check_for_nan_in_loss_and_grad", "check_for_spiky_loss",
    "check_weight_hash_across_dp_replicas_interval", "checkpoint_activations",
    "ckpt_assume_constant_structure", "ckpt_convert_format", "ckpt_convert_save",
    "ckpt_convert_update_legacy_dist_opt_format", "ckpt_format", "ckpt_fully_parallel_load",
    "ckpt_fully_parallel_save", "ckpt_fully_parallel_save_deprecated", "ckpt_step",
    "classes_fraction", "clip_grad", "clone_scatter_output_in_embedding", "config_logger_dir",
    "context_parallel_size", "cp_comm_type", "cpu_offloading_num_layers",
    "create_attention_mask_in_dataloader", "cross_entropy_fusion_impl", "cross_entropy_loss_fusion",
    "cuda_graph_impl", "cuda_graph_scope", "cuda_graph_warmup_steps", "data_args_path",
    "data_cache_path", "data_parallel_random_init", "data_parallel_sharding_strategy", "data_path",
    "data_per_class_fraction", "data_sharding", "dataloader_type", "ddp_average_in_collective",
    "ddp_bucket_size", "ddp_num_buckets", "ddp_pad_buckets_for_high_nccl_busbw",
    "ddp_reduce_scatter_with_fp32_accumulation", "decode_only_cuda_graphs",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "decoder_num_layers",
    "decoder_seq_length", "decoupled_lr", "decoupled_min_lr", "decrease_batch_size_if_needed",
    "defer_embedding_wgrad_compute", "delay_wgrad_compute", "deprecated_use_mcore_models",
    "deterministic_mode", "dino_bottleneck_size", "dino_freeze_last_layer", "dino_head_hidden_size",
    "dino_local_crops_number", "dino_local_img_size", "dino_norm_last_layer", "dino_teacher_temp",
    "dino_warmup_teacher_temp", "dino_warmup_teacher_temp_epochs",
    "disable_bf16_reduced_precision_matmul", "disable_chunked_prefill",
    "disable_mamba_mem_eff_path", "disable_straggler_on_startup", "disable_symmetric_registration",
    "dist_ckpt_format_deprecated", "dist_ckpt_optim_fully_reshardable",
    "dist_ckpt_save_pre_mcore_014", "dist_ckpt_strictness",
    "distrib_optim_fully_reshardable_mem_efficient", "distribute_saved_activations",
    "distributed_backend", "distributed_timeout_minutes", "distributed_timeout_seconds_after_init",
    "dump_param_to_param_group_map", "embedding_init_method_std", "embedding_path",
    "empty_unused_memory_level", "enable_cuda_graph", "enable_experimental", "enable_ft_package",
    "enable_full_sharding_in_hsdp", "enable_gloo_process_groups", "enable_msc", "enable_one_logger",
    "encoder_num_layers", "encoder_seq_length", "end_weight_decay", "eod_mask_loss",
    "error_injection_rate", "error_injection_type", "eval_interval", "eval_iters",
    "evidence_data_path", "exit_duration_in_mins", "exit_interval", "exit_on_missing_checkpoint",
    "exit_signal_handler", "exp_avg_dtype", "exp_avg_sq_dtype", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "external_cuda_graph", "ffn_hidden_size", "finetune",
    "first_last_layers_bf16", "flash_decode", "fp16", "fp16_lm_cross_entropy",
    "fp32_residual_connection", "fp4", "fp4_param", "fp4_quantizer_factory", "fp4_recipe", "fp8",
    "fp8_amax_compute_algo", "fp8_amax_history_len", "fp8_interval", "fp8_margin",
    "fp8_param_gather", "fp8_quantizer_factory", "fp8_recipe", "fp8_wgrad", "fsdp_double_buffer",
    "full_validation", "global_batch_size", "glu_linear_offset", "grad_reduce_in_bf16",
    "gradient_accumulation_fusion", "gradient_reduce_div_fusion", "group_query_attention",
    "grpo_clamp_eps_lower", "grpo_clamp_eps_upper", "grpo_default_temperature",
    "grpo_default_top_p", "grpo_entropy_term_weight", "grpo_filter_groups_with_same_reward",
    "grpo_group_size", "grpo_iterations", "grpo_kl_beta", "grpo_prompts_per_step", "head_lr_mult",
    "heterogeneous_layers_config_encoded_json", "heterogeneous_layers_config_path",
    "hidden_dropout", "hidden_size", "hierarchical_context_parallel_sizes",
    "high_priority_stream_groups", "hybrid_attention_ratio", "hybrid_mlp_ratio",
    "hybrid_override_pattern", "hysteresis", "ict_head_size", "ict_load", "img_h", "img_w",
    "indexer_batch_size", "indexer_log_interval", "inference_batch_times_seqlen_threshold",
    "inference_dynamic_batching", "inference_dynamic_batching_block_size",
    "inference_dynamic_batching_buffer_guaranteed_fraction",
    "inference_dynamic_batching_buffer_overflow_factor",
    "inference_dynamic_batching_buffer_size_gb", "inference_dynamic_batching_max_requests_override",
    "inference_dynamic_batching_max_tokens_override", "inference_dynamic_batching_num_cuda_graphs",
    "inference_dynamic_batching_track_paused_request_events",
    "inference_dynamic_batching_unified_memory_level", "inference_max_batch_size",
    "inference_max_seq_length", "inference_rng_tracker", "inference_wandb_logging_step_interval",
    "init_method_std", "init_method_xavier_uniform", "init_model_with_meta_device",
    "initial_loss_scale", "inprocess_active_world_size", "inprocess_barrier_timeout",
    "inprocess_completion_timeout", "inprocess_empty_cuda_cache", "inprocess_granularity",
    "inprocess_hard_timeout", "inprocess_heartbeat_interval", "inprocess_heartbeat_timeout",
    "inprocess_last_call_wait", "inprocess_max_iterations", "inprocess_monitor_process_interval",
    "inprocess_monitor_thread_interval", "inprocess_progress_watchdog_interval",
    "inprocess_restart", "inprocess_soft_timeout", "inprocess_termination_grace_time",
    "is_hybrid_model", "iter_per_epoch", "iterations_to_skip", "keep_fp8_transpose_cache",
    "kitchen_config_file", "kitchen_recipe_number", "kv_channels", "kv_lora_rank",
    "langrl_env_config", "langrl_external_server", "langrl_inference_server_conversation_template",
    "langrl_inference_server_type", "lazy_mpu_init", "legacy_tokenizer", "load",
    "load_main_params_from_ckpt", "local_rank", "log_energy", "log_interval",
    "log_loss_scale_to_tensorboard", "log_memory_to_tensorboard", "log_num_zeros_in_grad",
    "log_params_norm", "log_progress", "log_straggler", "log_throughput",
    "log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard",
    "log_world_size_to_tensorboard", "logging_level", "loss_scale", "loss_scale_window", "lr",
    "lr_decay_iters", "lr_decay_samples", "lr_decay_style", "lr_warmup_fraction", "lr_warmup_init",
    "lr_warmup_iters", "lr_warmup_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples",
    "lr_wsd_decay_style", "main_grads_dtype", "main_params_dtype", "make_vocab_size_divisible_by",
    "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim", "manual_gc",
    "manual_gc_eval", "manual_gc_interval", "mask_factor", "mask_prob", "mask_type",
    "masked_softmax_fusion", "max_position_embeddings", "max_tokens_to_oom", "memory_snapshot_path",
    "merge_file", "micro_batch_size", "microbatch_group_size_per_vp_stage",
    "mid_level_dataset_surplus", "min_loss_scale", "min_lr", "mlp_chunks_for_prefill",
    "mmap_bin_files", "mock_data", "model_parallel_size", "moe_apply_probs_on_input",
    "moe_aux_loss_coeff", "moe_deepep_num_sms", "moe_enable_deepep", "moe_expert_capacity_factor",
    "moe_extended_tp", "moe_ffn_hidden_size", "moe_grouped_gemm", "moe_input_jitter_eps",
    "moe_layer_freq", "moe_layer_recompute", "moe_pad_expert_input_to_capacity",
    "moe_pad_experts_for_cuda_graph_inference", "moe_per_layer_logging", "moe_permute_fusion",
    "moe_router_bias_update_rate", "moe_router_dtype", "moe_router_enable_expert_bias",
    "moe_router_force_load_balancing", "moe_router_fusion", "moe_router_group_topk",
    "moe_router_load_balancing_type", "moe_router_num_groups", "moe_router_padding_for_fp8",
    "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk",
    "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_overlap", "moe_token_dispatcher_type", "moe_token_drop_policy",
    "moe_upcycling_granularity", "moe_use_legacy_grouped_gemm", "moe_use_upcycling",
    "moe_z_loss_coeff", "mrope_section", "mscale", "mscale_all_dim", "mtp_loss_scaling_factor",
    "mtp_num_layers", "multi_latent_attention", "multiple_validation_sets",
    "muon_extra_scale_factor", "muon_fp32_matmul_prec", "muon_momentum", "muon_num_ns_steps",
    "muon_scale_mode", "muon_split_qkv", "muon_tp_mode", "muon_use_nesterov",
    "nccl_all_reduce_for_prefill", "nccl_communicator_config_path", "nccl_ub", "no_load_optim",
    "no_load_rng", "no_persist_layer_norm", "no_rope_freq", "no_save_optim", "no_save_rng",
    "non_persistent_ckpt_type", "non_persistent_global_ckpt_dir", "non_persistent_local_ckpt_algo",
    "non_persistent_local_ckpt_dir", "non_persistent_save_interval", "norm_epsilon",
    "normalization", "num_attention_heads", "num_channels", "num_classes",
    "num_dataset_builder_threads", "num_distributed_optimizer_instances", "num_experts",
    "num_layers", "num_layers_at_end_in_bf16", "num_layers_at_start_in_bf16",
    "num_layers_per_virtual_pipeline_stage", "num_query_groups",
    "num_virtual_stages_per_pipeline_rank", "num_workers", "object_storage_cache_path",
    "one_logger_async", "one_logger_project", "one_logger_run_name", "onnx_safe", "openai_gelu",
    "optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction", "output_bert_embeddings",
    "overlap_cpu_optimizer_d2h_h2d", "overlap_grad_reduce", "overlap_moe_expert_parallel_comm",
    "overlap_p2p_comm", "overlap_p2p_comm_warmup_flush", "overlap_param_gather",
    "overlap_param_gather_with_optimizer_step", "override_opt_param_scheduler", "padded_vocab_size",
    "patch_dim", "per_split_data_args_path", "perform_initialization", "perform_rl_step",
    "pin_cpu_grads", "pin_cpu_params", "pipeline_model_parallel_comm_backend",
    "pipeline_model_parallel_layout", "pipeline_model_parallel_size", "position_embedding_type",
    "pretrained_checkpoint", "profile", "profile_ranks", "profile_step_end", "profile_step_start",
    "q_lora_rank", "qk_head_dim", "qk_l2_norm", "qk_layernorm", "qk_pos_emb_head_dim",
    "query_in_block_prob", "quick_geglu", "rampup_batch_size", "recompute_activations",
    "recompute_granularity", "recompute_method", "recompute_modules", "recompute_num_layers",
    "record_memory_history", "relative_attention_max_distance", "relative_attention_num_buckets",
    "replication", "replication_factor", "replication_jump", "rerun_mode", "reset_attention_mask",
    "reset_position_ids", "result_rejected_tracker_filename", "retriever_report_topk_accuracies",
    "retriever_score_scaling", "retriever_seq_length", "retro_add_retriever",
    "retro_attention_gate", "retro_cyclic_train_iters", "retro_encoder_attention_dropout",
    "retro_encoder_hidden_dropout", "retro_encoder_layers", "retro_num_neighbors",
    "retro_num_retrieved_chunks", "retro_project_dir", "retro_verify_neighbor_count",
    "reuse_grad_buf_for_mxfp8_param_ag", "rl_calculate_intra_group_similarity",
    "rl_importance_sampling_truncation_coef", "rl_inference_logprobs_is_correction",
    "rl_offload_kv_cache_during_training", "rl_offload_optimizer_during_inference",
    "rl_partial_rollouts", "rl_prompts_per_eval", "rl_remove_kv_cache_during_training",
    "rl_reset_cuda_graphs", "rl_sequence_packing_algo", "rl_sequence_packing_bin_size",
    "rl_use_sequence_packing", "rope_scaling_factor", "rope_type", "rotary_base",
    "rotary_interleaved", "rotary_percent", "rotary_scaling_factor",
    "rotary_seq_len_interpolation_factor", "run_workload_inspector_server", "sample_rate", "save",
    "save_interval", "save_retain_interval", "scatter_gather_tensors_in_pipeline", "seed",
    "seq_length", "sequence_parallel", "sft", "sft_tokenizer_prompt_format", "sgd_momentum",
    "sharp_enabled_group", "short_seq_prob", "skip_train", "softmax_type", "spec", "split",
    "squared_relu", "start_weight_decay", "straggler_ctrlr_port", "straggler_minmax_count",
    "strict_fsdp_dtensor_load", "suggested_communication_unit_size", "swiglu", "swin_backbone_type",
    "symmetric_ar_type", "te_rng_tracker", "tensor_model_parallel_size", "tensorboard_dir",
    "tensorboard_log_interval", "tensorboard_queue_size", "test_data_path", "test_mode",
    "tiktoken_num_special_tokens", "tiktoken_pattern", "tiktoken_special_tokens",
    "timing_log_level", "timing_log_option", "titles_data_path", "tokenizer_metadata",
    "tokenizer_model", "tokenizer_type", "torch_fsdp2_reshard_after_forward",
    "tp_comm_bootstrap_backend", "tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad", "tp_comm_overlap",
    "tp_comm_overlap_ag", "tp_comm_overlap_cfg", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad",
    "tp_comm_split_ag", "tp_comm_split_rs", "train_data_path", "train_iters", "train_samples",
    "train_sync_interval", "transformer_impl", "trust_remote_code",
    "untie_embeddings_and_output_weights", "use_checkpoint_args",
    "use_checkpoint_opt_param_scheduler", "use_cpu_initialization", "use_dist_ckpt_deprecated",
    "use_distributed_optimizer", "use_flash_attn", "use_fused_weighted_squared_relu",
    "use_legacy_models", "use_legacy_static_engine", "use_megatron_fsdp",
    "use_mp_args_from_checkpoint_args", "use_one_sent_docs", "use_persistent_ckpt_worker",
    "use_precision_aware_optimizer", "use_pytorch_profiler", "use_ring_exchange_p2p",
    "use_rope_scaling", "use_rotary_position_embeddings", "use_sharp", "use_te_activation_func",
    "use_tokenizer_model_from_checkpoint_args", "use_torch_fsdp2",
    "use_torch_optimizer_for_cpu_offload", "use_tp_pp_dp_mapping", "v_head_dim", "valid_data_path",
    "vision_backbone_type", "vision_pretraining", "vision_pretraining_type", "vocab_extra_ids",
    "vocab_file", "vocab_size", "wandb_entity", "wandb_exp_name", "wandb_project", "wandb_save_dir",
    "warmup", "weight_decay", "weight_decay_incr_style", "wgrad_deferral_limit",
    "window_attn_skip_freq", "window_size", "yaml_cfg",
})

# fmt: on


# The DeepSpeed release whose rules the offline checks model, where releases differ. Read from the
# released sdists: precision_config.py (DeepSpeedFP16Config / DeepSpeedBF16Config, pydantic,
# extra="forbid", lax bool/int coercion) first ships in 0.17.3 (0.17.0 and 0.16.9 read fp16/bf16
# with get_scalar_param, a plain dict.get); runtime/config.py's _REMOVED_TOP_LEVEL_CONFIG_KEYS
# and DEEPSPEED_OPTIMIZERS without the 1-bit optimizers first ship in 0.19 (issue #8489).
NEWEST_RELEASE = "0.19.8"
RELEASE_ENV = "DSTRAIN_DEEPSPEED_RELEASE"  # an older release to judge by, e.g. 0.16.9


@dataclass(frozen=True)
class Release:
    """The rules of one DeepSpeed release, where they differ from others."""

    name: str
    pydantic_precision: bool  # fp16/bf16: "false" is false, unknown keys refused (0.17.3+)
    removed_features: bool  # amp, elasticity, OneBitAdam, ... refused (0.19+)


def release(name: str | None = None) -> Release:
    """`name` (None: $DSTRAIN_DEEPSPEED_RELEASE, else the newest release) as a rule set."""
    name = (name or os.environ.get(RELEASE_ENV) or NEWEST_RELEASE).strip().lstrip("v")
    match = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?\S*", name)
    if match is None:
        raise UserError(
            f"DeepSpeed release {name!r} (--deepspeed-release or ${RELEASE_ENV}) is not a "
            "version number",
            f"give a release such as {NEWEST_RELEASE}, 0.18.9 or 0.16.9",
            exit_code=2,
        )
    version = tuple(int(part or 0) for part in match.groups())
    return Release(name, version >= (0, 17, 3), version >= (0, 19, 0))


# Top-level keys (and zero_optimization keys) 0.19 refuses with a DeepSpeedConfigError naming the
# removed feature (runtime/config.py, _reject_removed_config_keys).
DS_REMOVED_TOP_LEVEL: frozenset[str] = frozenset(
    {
        "nebula",
        "compression_training",
        "amp",
        "quantize_training",
        "sparse_gradients",
        "eigenvalue",
        "sparse_attention",
        "elasticity",
        "graph_harvesting",
        "curriculum_learning",
        "progressive_layer_drop",
    }
)
DS_REMOVED_ZERO: frozenset[str] = frozenset(
    {
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "zeropp_loco_param",
    }
)
