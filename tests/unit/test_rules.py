"""Every `check` rule, with a failing and a passing case."""

import pytest

from dstrain.config.load import load_config
from dstrain.config.parallel_dims import stage_trim
from dstrain.preflight.preflight import preflight


def findings(*overrides: str, world: int | None = None):
    return preflight(load_config(None, list(overrides)), world)


def errors(*overrides: str, world: int | None = None) -> dict[str, str]:
    return {f.key: f.message for f in findings(*overrides, world=world) if f.severity == "error"}


def warnings(*overrides: str, world: int | None = None) -> dict[str, str]:
    return {f.key: f.message for f in findings(*overrides, world=world) if f.severity == "warning"}


def test_defaults_are_clean_on_one_rank():
    assert errors(world=1) == {}
    assert warnings(world=1) == {}


def test_world_size_must_equal_the_product_of_degrees():
    assert "parallel" in errors("parallel.dp_shard=2", "parallel.tp=2", world=8)
    assert errors("parallel.dp_shard=2", "parallel.tp=2", world=4) == {}


def test_world_size_that_leaves_no_dp_shard():
    assert "parallel.dp_shard" in errors("parallel.tp=4", world=6)
    assert errors("parallel.tp=4", "model.num_heads=4", world=8) == {}


def test_ep_folds_over_dp_shard_cp_tp():
    moe = ("model.num_routed_experts=8",)
    assert "parallel.ep" in errors(*moe, "parallel.ep=4", "parallel.dp_shard=2", world=2)
    assert errors(*moe, "parallel.ep=4", "parallel.dp_shard=2", "parallel.tp=2", world=4) == {}
    assert errors(*moe, "parallel.ep=2", "parallel.dp_shard=2", world=2) == {}


def test_batch_mismatch_and_inference():
    bad = errors(
        "train.global_batch_size=64",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=4",
        world=2,
    )
    assert "64" in bad["train.global_batch_size"] and "32" in bad["train.global_batch_size"]
    notes = [
        f
        for f in findings("train.global_batch_size=64", "train.micro_batch_size=4", world=2)
        if f.severity == "info" and f.key == "train.grad_accum_steps"
    ]
    assert notes and "grad_accum_steps = 8" in notes[0].message


def test_batch_not_divisible():
    assert "train.global_batch_size" in errors(
        "train.global_batch_size=30", "train.micro_batch_size=4", world=2
    )
    assert errors("train.global_batch_size=32", "train.micro_batch_size=4", world=2) == {}


def test_batch_without_world_size_still_checks_divisibility():
    assert "train.global_batch_size" in errors(
        "train.global_batch_size=30", "train.micro_batch_size=4", "train.grad_accum_steps=4"
    )


PP2 = ("parallel.pp=2", "parallel.dp_shard=1")


EVEN = ("parallel.pp_first_stage_less_layers=0", "parallel.pp_last_stage_less_layers=0")


def test_layers_must_split_over_pipeline_stages():
    bad = errors(*PP2, *EVEN, "model.num_layers=5", "train.grad_accum_steps=4", world=2)
    assert "parallel.pp" in bad
    trimmed = ("parallel.pp_first_stage_less_layers=0", "parallel.pp_last_stage_less_layers=1")
    ok = errors(*PP2, *trimmed, "model.num_layers=5", "train.grad_accum_steps=4", world=2)
    assert ok == {}
    # The default trims automatically, and one given side is completed.
    assert errors(*PP2, "model.num_layers=5", "train.grad_accum_steps=4", world=2) == {}
    assert stage_trim(5, 2, None, None) == (0, 1)
    assert stage_trim(5, 2, 1, None) == (1, 0)
    assert stage_trim(5, 2, None, 3) == (0, 3)


def test_fewer_layers_than_stages_is_an_error():
    v = ("parallel.pp_schedule=interleaved-1f1b", "parallel.num_virtual_stages=4")
    bad = errors(*PP2, *v, "model.num_layers=4", "train.grad_accum_steps=4", world=2)
    assert "cannot fill 8 pipeline stages" in bad["parallel.pp"]


def test_trimming_suggestion_for_deepseek_v3_pp16():
    v3 = ("model.flavor=deepseek-v3", "parallel.pp=16", "parallel.dp_shard=1")
    rest = ("train.grad_accum_steps=32", "train.seq_len=4096")
    layer = next(f for f in findings(*v3, *EVEN, *rest, world=16) if f.key == "parallel.pp")
    assert "pp_first_stage_less_layers=1" in layer.fix
    assert "pp_last_stage_less_layers=2" in layer.fix
    assert stage_trim(61, 16, None, None) == (1, 2)  # the default does exactly that
    assert errors(*v3, *rest, world=16) == {}


def test_fewer_microbatches_than_stages():
    assert "parallel.num_microbatches" in errors(*PP2, "train.grad_accum_steps=1", world=2)
    assert "parallel.num_microbatches" not in errors(*PP2, "train.grad_accum_steps=2", world=2)


def test_dualpipev_needs_microbatches_for_every_stage():
    v = ("parallel.pp_schedule=dualpipev", "parallel.num_virtual_stages=2")
    assert "parallel.num_microbatches" in errors(*PP2, *v, "train.grad_accum_steps=3", world=2)
    assert errors(*PP2, *v, "train.grad_accum_steps=4", world=2) == {}


def test_v_shaped_schedules_need_exactly_two_stages_per_rank():
    for schedule in ("zbv", "dualpipev"):
        base = (*PP2, f"parallel.pp_schedule={schedule}", "train.grad_accum_steps=8")
        bad = errors(*base, "parallel.num_virtual_stages=3", world=2)
        assert "V-shaped" in bad["parallel.num_virtual_stages"]
        assert errors(*base, "parallel.num_virtual_stages=2", world=2) == {}
        # Left unset, the V implies its 2 stages per rank.
        assert errors(*base, world=2) == {}
        assert load_config(None, list(base)).config.parallel.num_virtual_stages == 2


def test_interleaved_needs_several_stages_and_whole_rounds():
    base = (*PP2, "parallel.pp_schedule=interleaved-1f1b")
    assert "parallel.num_virtual_stages" in errors(*base, "train.grad_accum_steps=4", world=2)
    assert "parallel.num_microbatches" in errors(
        *base, "parallel.num_virtual_stages=2", "train.grad_accum_steps=5", world=2
    )
    assert errors(*base, "parallel.num_virtual_stages=2", "train.grad_accum_steps=4", world=2) == {}


def test_single_stage_schedules_reject_virtual_stages():
    assert "parallel.num_virtual_stages" in errors(
        *PP2, "parallel.num_virtual_stages=2", "train.grad_accum_steps=4", world=2
    )


def test_routed_experts_must_divide_by_ep():
    assert "parallel.ep" in errors(
        "model.num_routed_experts=6", "model.n_group=1", "parallel.ep=4", world=4
    )
    assert errors("model.num_routed_experts=8", "parallel.ep=4", world=4) == {}


def test_ep_needs_experts():
    assert "parallel.ep" in errors(
        "model.flavor=deepseek-llm-7b", "parallel.ep=2", "train.seq_len=128", world=2
    )


def test_group_limited_routing_consistency():
    assert "model.n_group" in errors("model.n_group=3", world=1)
    assert "model.num_activated_experts" in errors(
        "model.num_activated_experts=5", "model.topk_group=1", world=1
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.num_heads=6", "model.num_heads"),
        ("model.vocab_size=2050", "model.vocab_size"),
        ("model.inter_dim=390", "model.inter_dim"),
        ("model.moe_inter_dim=66", "model.moe_inter_dim"),
    ],
)
def test_tensor_parallel_divisibility(override, key):
    assert key in errors("parallel.tp=4", "parallel.dp_shard=1", override, world=4)


def test_tensor_parallel_clean_case_and_kv_heads():
    assert errors("parallel.tp=4", "parallel.dp_shard=1", world=4) == {}
    mha = ("model.attention=mha", "model.num_heads=8", "model.num_kv_heads=2")
    assert "model.num_kv_heads" in errors("parallel.tp=4", "parallel.dp_shard=1", *mha, world=4)


def test_sequence_parallel_needs_divisible_sequence():
    assert "train.seq_len" in errors(
        "parallel.tp=4", "parallel.dp_shard=1", "train.seq_len=66", world=4
    )
    assert "train.seq_len" not in errors(
        "parallel.tp=4",
        "parallel.dp_shard=1",
        "parallel.sequence_parallel=false",
        "train.seq_len=66",
        world=4,
    )


def test_zero3_with_pipeline_is_rejected():
    assert "parallel.zero_stage" in errors(
        *PP2, "parallel.zero_stage=3", "train.grad_accum_steps=4", world=2
    )
    assert errors(*PP2, "parallel.zero_stage=2", "train.grad_accum_steps=4", world=2) == {}


def test_offload_needs_zero():
    assert "parallel.offload_optimizer" in errors(
        "parallel.offload_optimizer=true", "parallel.zero_stage=0", world=2
    )
    assert "parallel.offload_params" in errors(
        "parallel.offload_params=true", "parallel.zero_stage=2", world=2
    )
    assert (
        errors(
            "parallel.offload_params=true",
            "parallel.offload_optimizer=true",
            "parallel.zero_stage=3",
            world=2,
        )
        == {}
    )


def test_tensor_parallel_with_data_parallel_needs_fsdp():
    # An error, as the trainer refuses it: one truth for check, plan and train.
    assert "parallel.zero_stage" in errors(
        "parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=0", world=4
    )
    for stage in (1, 2):
        found = errors(
            "parallel.tp=2", "parallel.dp_shard=2", f"parallel.zero_stage={stage}", world=4
        )
        assert found == {}, stage
    assert (
        errors("parallel.ep=2", "parallel.dp_shard=2", "parallel.zero_stage=0", world=2) == {}
    )  # DDP leaves the experts to dstrain


def test_compression_hooks_need_ddp():
    assert "comm.compression" in errors(
        "comm.compression=powersgd", "parallel.zero_stage=2", world=2
    )
    assert "comm.compression" in errors(
        "comm.compression=powersgd", "parallel.zero_stage=1", world=2
    )
    assert errors("comm.compression=powersgd", "parallel.zero_stage=0", world=2) == {}


def test_fp16_on_bf16_hardware_warns():
    assert "train.precision" in warnings("train.precision=fp16", "cluster.gpu=H100", world=1)
    assert "train.precision" not in warnings("train.precision=bf16", "cluster.gpu=H100", world=1)
    assert "train.precision" not in warnings("train.precision=fp16", "cluster.gpu=V100", world=1)


def test_bf16_on_hardware_without_it_fails():
    assert "train.precision" in errors("train.precision=bf16", "cluster.gpu=V100", world=1)


def test_fp16_on_cpu_warns():
    assert (
        "fp16 matmuls on CPUs"
        in warnings("train.precision=fp16", "cluster.gpu=cpu", world=1)["train.precision"]
    )


def test_learning_rate_sanity():
    assert "far below" in warnings("optim.lr=1e-8", world=1)["optim.lr"]
    assert "far above" in warnings("optim.lr=0.5", world=1)["optim.lr"]
    assert "optim.lr" not in warnings("optim.lr=3e-4", world=1)


def test_warmup_longer_than_training():
    assert "lr.warmup_steps" in warnings("lr.warmup_steps=300", "train.steps=200", world=1)


def test_sequence_longer_than_positions():
    assert "train.seq_len" in errors("train.seq_len=1024", world=1)


def test_missing_data_and_resume_paths(tmp_path):
    assert "data.source" in errors(f"data.source={tmp_path / 'nope.jsonl'}", world=1)
    assert "checkpoint.resume" in errors(f"checkpoint.resume={tmp_path / 'ckpt'}", world=1)
    assert errors(f"data.source={tmp_path}", world=1) == {}


def test_unknown_gpu_and_network():
    bad = errors("cluster.gpu=H1000", "cluster.network=ib-xdr", world=1)
    assert "did you mean `H100`" in bad["cluster.gpu"]
    assert "cluster.network" in bad


def test_cluster_disagreeing_with_world_size():
    assert "cluster" in errors("cluster.nodes=2", "cluster.gpus_per_node=8", world=8)


def test_tp_across_nodes_warns():
    assert "parallel.tp" in warnings(
        "parallel.tp=16",
        "cluster.gpus_per_node=8",
        "model.num_heads=16",
        "model.vocab_size=2048",
        "model.inter_dim=384",
        "train.seq_len=128",
        world=16,
    )


def test_context_parallel_composes_and_refuses_what_it_cannot_run_with_reasons():
    no_mtp = "model.num_mtp_modules=0"
    assert errors("parallel.cp=2", no_mtp, world=2) == {}
    assert errors("parallel.cp=2", "parallel.dp_shard=2", no_mtp, world=4) == {}
    assert errors("parallel.cp=2", "parallel.tp=2", "parallel.ep=2", world=4) == {}
    assert errors("parallel.cp=2", "parallel.pp=2", "model.num_layers=4", world=4) == {}
    hsdp = ("parallel.dp_replicate=2", "parallel.zero_stage=3")
    assert errors("parallel.cp=2", *hsdp, world=4) == {}
    assert errors("parallel.cp=2", world=2) == {}  # with MTP (the debug flavor's)
    odd = errors("parallel.cp=2", no_mtp, "train.seq_len=126", world=2)
    assert "2 x cp = 4 equal chunks" in odd["train.seq_len"]
    assert errors("parallel.cp=2", "model.aux_loss_alpha=0.001", world=2) == {}
    assert errors("parallel.cp=2", "data.document_mask=true", world=2) == {}


def test_unknown_flavor_is_a_finding():
    bad = errors("model.flavor=deepseek-v4", world=1)
    assert "did you mean" in bad["model"]


def test_profile_steps_must_be_in_order_and_inside_the_run():
    assert "metrics.profile_steps" in errors('metrics.profile_steps="5:3"', world=1)
    late = warnings('metrics.profile_steps="500:501"', "train.steps=100", world=1)
    assert "nothing will be profiled" in late["metrics.profile_steps"]
    assert errors('metrics.profile_steps="5:7"', world=1) == {}
    assert warnings('metrics.profile_steps="5:7"', world=1) == {}


def test_prometheus_ports_of_every_local_rank_must_exist():
    assert "metrics.prometheus_port" in errors("metrics.prometheus_port=65534", world=8)
    assert errors("metrics.prometheus_port=65528", world=8) == {}  # 65528 + 7 local ranks
    (refused,) = [
        f for f in findings("metrics.prometheus_port=65534", world=8) if f.severity == "error"
    ]
    assert refused.fix == "use a port <= 65528"  # the highest that leaves every rank a port


DUALPIPEV = ("parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.num_virtual_stages=2")


def test_pp_overlap_without_overlapped_pairs_warns():
    assert "parallel.pp_overlap" in warnings("parallel.pp_overlap=true", "parallel.pp=2", world=2)
    assert "parallel.pp_overlap" in warnings("parallel.pp_overlap=true", world=1)
    assert "parallel.pp_overlap" not in warnings(*DUALPIPEV, "parallel.pp_overlap=true", world=2)
    # Unset (auto) and false never warn: auto is on only where the schedule has pairs.
    assert "parallel.pp_overlap" not in warnings("parallel.pp=2", world=2)
    assert "parallel.pp_overlap" not in warnings(
        "parallel.pp_overlap=false", "parallel.pp=2", world=2
    )


def test_a_missing_init_from_folder_is_one_error_naming_it(tmp_path):
    # the architecture comes from the folder too: one finding, on the key to fix
    bad = errors(f"model.init_from={tmp_path / 'nowhere'}", world=2)
    assert list(bad) == ["model.init_from"], bad


def test_virtual_stages_without_a_pipeline_split_nothing():
    """At pp=1 the layers are not split, however many stages per rank are set: a warning that
    the setting does nothing, not an error about an uneven split (3 layers over 2 stages)."""
    overrides = (
        "parallel.num_virtual_stages=2",
        "model.num_layers=3",
        "parallel.pp_first_stage_less_layers=0",
        "parallel.pp_last_stage_less_layers=0",
    )
    assert errors(*overrides, world=1) == {}
    assert "no effect at pp=1" in warnings(*overrides, world=1)["parallel.num_virtual_stages"]
