"""The communication model of dstrain.planner.comm: pure arithmetic, no torch."""

import math
import time

import pytest

from dstrain.config.flavors import flavor_args
from dstrain.config.model_args import ModelArgs
from dstrain.hardware import gpu_spec
from dstrain.planner.comm import (
    AXES,
    NVLS_LATENCY_S,
    OPS,
    CommConstants,
    bus_factor,
    collective,
    collective_time,
    comm_per_step,
    group_span,
    group_time,
    link_kind,
)
from dstrain.planner.layout import Cluster, Layout

H100 = gpu_spec("H100")  # 450 GB/s NVLink per GPU, one direction
CONSTS = CommConstants()
NO_LATENCY = CommConstants(alpha_intra_s=0.0, alpha_inter_s=0.0, base_latency_s=0.0)
A100 = gpu_spec("A100-80GB")  # 300 GB/s NVLink, no NVLink SHARP
V3 = flavor_args("deepseek-v3")


def cluster(num_gpus: int = 1024) -> Cluster:
    return Cluster(H100, num_gpus, gpus_per_node=8, inter_node_gbps=50.0)


def step(args: ModelArgs, layout: Layout, consts: CommConstants = CONSTS, **kwargs):
    counts = dict(
        layers_per_rank=1, moe_layers_per_rank=0, dense_params_per_rank=0, expert_params_per_rank=0
    )
    return comm_per_step(args, layout, cluster(), consts, **{**counts, **kwargs})


def test_ring_formulas_match_hand_computed_values():
    s, bw, alpha = 1e9, 100.0, 1e-5  # 1 GB over 100 GB/s: 10 ms of pure transfer
    assert collective_time("all_reduce", s, 8, bw, alpha) == pytest.approx(2 * 7 / 8 * 0.01 + 14e-5)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(op, s, 8, bw, alpha) == pytest.approx(7 / 8 * 0.01 + 7e-5)
    assert collective_time("p2p", s, 2, bw, alpha) == pytest.approx(0.01 + 1e-5)


@pytest.mark.parametrize("n", [2, 4, 8, 64, 1000])
def test_bus_bandwidth_factors_are_nccl_tests(n):
    """doc/PERFORMANCE.md of nccl-tests: busbw = algbw * factor, and busbw is the link's speed."""
    published = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "p2p": 1.0,
    }
    size, link = 2**30, 123.0
    for op in OPS:
        assert bus_factor(op, n) == pytest.approx(published[op])
        algbw = size / collective_time(op, size, n, link, 0.0) / 1e9
        assert algbw * published[op] == pytest.approx(link)


@pytest.mark.parametrize("op", OPS)
def test_one_rank_costs_nothing(op):
    assert collective_time(op, 1e9, 1, 100.0, 1e-5) == 0.0
    assert group_time(op, 1e9, 1, 8, cluster(), CONSTS, calls=10) == 0.0


def test_unknown_names_are_errors():
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", 1.0, 2, 1.0, 0.0)
    with pytest.raises(ValueError, match="unknown axis"):
        group_span("dp_shard", Layout(dp=2))


def test_group_spans_follow_the_trainer_rank_order():
    layout = Layout(dp=4, tp=4, pp=2, cp=2, ep=8)
    assert group_span("tp", layout) == (4, 1)
    assert group_span("cp", layout) == (2, 4)
    assert group_span("dp", layout) == (8, 4)  # dp x cp: ranks with the same dense weights
    assert group_span("ep", layout) == (8, 1)
    assert group_span("edp", layout) == (4, 8)  # dp*cp*tp/ep, strided by ep
    assert group_span("pp", layout) == (2, 32)
    assert {a for a in AXES} == {"tp", "cp", "dp", "ep", "edp", "pp"}


def test_tp_in_a_node_uses_nvlink_and_dp_across_nodes_the_network():
    c, layout, size = cluster(128), Layout(dp=16, tp=8), 1e9
    n, stride = group_span("tp", layout)
    assert link_kind(n, stride, c) == "intra"
    nvlink = H100.intra_node_gbps * CONSTS.bw_efficiency_intra
    ring = collective_time("all_gather", size, 8, nvlink, CONSTS.alpha_intra_s)
    expected = ring + CONSTS.base_latency_s  # NCCL's per-call latency on top of the steps
    assert group_time("all_gather", size, n, stride, c, CONSTS) == pytest.approx(expected)

    # dp: 16 ranks, one per node (stride 8): a ring over the network, one NIC each
    n, stride = group_span("dp", layout)
    assert (n, stride) == (16, 8) and link_kind(n, stride, c) == "inter"
    network = 50.0 * CONSTS.bw_efficiency_inter
    steps = 15 * CONSTS.alpha_inter_s
    expected = collective_time("all_gather", size, 16, network, 0.0) + steps
    assert group_time("all_gather", size, n, stride, c, CONSTS) == pytest.approx(
        expected + CONSTS.base_latency_s
    )


def test_a_ring_across_nodes_uses_the_nics_of_its_members_on_a_node():
    """NCCL runs a ring channel per NIC: a group with k members per node crosses to the next
    node over k NICs at once (8 x 200 Gb/s DGX A100: 192 GB/s all-reduce busbw, nccl#812),
    up to the node's own NVLink."""
    c, size = cluster(64), 8e9
    one = group_time("all_gather", size, 8, 8, c, NO_LATENCY)  # one member per node
    four = group_time("all_gather", size, 32, 2, c, NO_LATENCY)  # four per node
    eight = group_time("all_gather", size, 64, 1, c, NO_LATENCY)  # the whole node
    nic = 50e9 * CONSTS.bw_efficiency_inter
    assert one == pytest.approx(7 / 8 * size / nic)
    assert four == pytest.approx(31 / 32 * size / (4 * nic))
    nvlink = 450e9 * CONSTS.bw_efficiency_intra
    assert eight == pytest.approx(63 / 64 * size / min(8 * nic, nvlink))


def test_a_ring_across_nodes_pays_network_latency_only_on_node_crossings():
    """NCCL's ring latency (tuning.cc): nInterSteps = nodes-1 per pass, the rest intra-node."""
    c = cluster(16)
    a_i, a_e = CONSTS.alpha_intra_s, CONSTS.alpha_inter_s
    latency = group_time("all_gather", 0.0, 16, 1, c, CONSTS)
    assert latency == pytest.approx(14 * a_i + 1 * a_e + CONSTS.base_latency_s)


def test_all_reduce_over_many_nodes_takes_the_tree_and_large_ones_the_ring():
    c = cluster(1024)
    latency, algorithm = collective("all_reduce", 0.0, 128, 8, c, CONSTS)  # one rank per node
    assert algorithm == "tree"
    assert latency == pytest.approx(2 * 7 * CONSTS.alpha_inter_s + CONSTS.base_latency_s)
    # the tree's bandwidth is 0.92 of the ring's: a large message goes round the ring
    assert collective("all_reduce", 1e11, 128, 8, c, CONSTS)[1] == "ring"


def test_nvlink_sharp_all_reduces_inside_hopper_nodes():
    """NVLS (NCCL >= 2.17, Hopper behind NVSwitch): ~480 GB/s all-reduce busbw on 8 x H100
    against ~370 with rings; 25 us a call. A100 nodes have none."""
    big = 8e9
    hopper, ampere = cluster(8), Cluster(A100, 8)
    seconds, algorithm = collective("all_reduce", big, 8, 1, hopper, NO_LATENCY)
    assert algorithm == "nvls"
    assert seconds == pytest.approx(2 * 7 / 8 * big / (450e9 * 480 / 450) + NVLS_LATENCY_S)
    assert collective("all_reduce", big, 8, 1, ampere, CONSTS)[1] == "ring"
    assert collective("all_gather", big, 8, 1, hopper, CONSTS)[1] == "ring"


def test_all_to_all_over_8_nodes_sends_7_8_of_its_bytes_over_the_network():
    c, layout, size = cluster(64), Layout(dp=64, ep=64), 8e9
    n, stride = group_span("ep", layout)
    assert (n, stride) == (64, 1) and link_kind(n, stride, c) == "inter"
    network = 50e9 * CONSTS.bw_efficiency_inter
    inter = 56 / 64 * size / network + 56 * CONSTS.alpha_inter_s + CONSTS.base_latency_s
    assert group_time("all_to_all", size, n, stride, c, CONSTS) == pytest.approx(inter)
    # Less than a flat all-to-all over the network: 1/8 of the bytes stays on NVLink.
    flat = collective_time("all_to_all", size, 64, 50.0 * 0.9, CONSTS.alpha_inter_s)
    assert inter < flat + CONSTS.base_latency_s


def test_tp_moves_four_activation_all_reduces_per_layer():
    layout = Layout(dp=1, tp=8, micro_batch=1, global_batch=1, seq_len=4096)
    tp = step(V3, layout, holds_head=False).tp
    activation = 4096 * 7168 * 2  # tokens x dim x bf16
    assert tp.bytes == 4 * activation and tp.group_size == 8 and tp.link == "intra"
    assert tp.exposed_seconds == tp.seconds > 0

    sp = step(V3, layout.with_(sequence_parallel=True), holds_head=False).tp
    assert sp.bytes == 2 * tp.bytes  # a reduce-scatter and an all-gather for each all-reduce
    # the same ring time on a ring; NVLink SHARP speeds the all-reduce on this H100 node
    assert sp.seconds > tp.seconds

    full = step(V3, layout.with_(recompute="full"), holds_head=False).tp
    assert full.bytes == 6 * activation  # the forward's two run again in backward

    # dstrain's loss is vocab-parallel: the head adds no all-gather of the logits (issue 30)
    assert step(V3, layout, holds_head=True).tp.bytes == tp.bytes
    gathered = step(V3, layout.with_(engine="composer"), holds_head=True).tp
    logits = (1 + V3.num_mtp_modules) * 4096 * V3.vocab_size * 2
    assert gathered.bytes == tp.bytes + logits


def test_ep_bytes_for_deepseek_v3():
    assert (V3.dim, V3.num_activated_experts) == (7168, 8)
    layout = Layout(dp=64, ep=64, micro_batch=1, global_batch=64, seq_len=4096)
    ep = step(V3, layout, moe_layers_per_rank=1).ep
    per_all_to_all = 4096 * 8 * 7168 * 2  # token copies routed x dim x bf16: 470 MB
    assert ep.bytes == 4 * per_all_to_all  # dispatch + combine, forward and backward
    assert ep.group_size == 64 and ep.link == "inter"
    assert ep.exposed_seconds == ep.seconds


def test_dualpipev_pairs_hide_only_their_own_ep_traffic_and_no_pp_traffic():
    # 16 micro-batches at pp2: 27 of each rank's 32 chunks run in overlapped pairs.
    base = Layout(dp=64, ep=64, pp=2, micro_batch=1, global_batch=1024, seq_len=4096)
    dual = base.with_(schedule="dualpipev")
    assert dual.paired_share == pytest.approx(27 / 32)
    exposed = step(V3, dual, moe_layers_per_rank=1).ep
    assert exposed.exposed_seconds == exposed.seconds  # no compute to hide behind
    hidden = step(V3, dual, moe_layers_per_rank=1, overlap_compute_s=100.0)
    assert hidden.ep.exposed_seconds == pytest.approx(exposed.seconds * 5 / 32)
    assert hidden.pp.exposed_seconds == hidden.pp.seconds  # p2p runs outside the pairs
    half = step(V3, dual, moe_layers_per_rank=1, overlap_compute_s=exposed.seconds / 2).ep
    assert half.exposed_seconds == pytest.approx(exposed.seconds / 2)
    off = dual.with_(pp_overlap=False)
    assert off.paired_share == 0.0
    sequential = step(V3, off, moe_layers_per_rank=1, overlap_compute_s=100.0).ep
    assert sequential.exposed_seconds == sequential.seconds
    plain = step(V3, base, moe_layers_per_rank=1, overlap_compute_s=100.0).ep
    assert plain.exposed_seconds == plain.seconds  # 1f1b has no pairs


def test_shared_experts_hide_the_forward_dispatch_only_with_ep_overlap():
    layout = Layout(dp=64, ep=64, micro_batch=1, global_batch=64, seq_len=4096)
    ep = step(V3, layout, moe_layers_per_rank=1, shared_forward_s=100.0).ep
    assert ep.exposed_seconds == pytest.approx(ep.seconds * 3 / 4)  # 1 of 4 all-to-alls
    short = step(V3, layout, moe_layers_per_rank=1, shared_forward_s=ep.seconds / 8).ep
    assert short.exposed_seconds == pytest.approx(ep.seconds * 7 / 8)
    off = step(V3, layout.with_(ep_overlap=False), moe_layers_per_rank=1, shared_forward_s=100.0)
    assert off.ep.exposed_seconds == off.ep.seconds


def test_split_tokens_halve_the_ep_bytes_at_tp2():
    layout = Layout(dp=32, tp=2, ep=64, micro_batch=1, global_batch=64, seq_len=4096)
    split = step(V3, layout, moe_layers_per_rank=1).ep
    repeat = step(V3, layout.with_(moe_tp="repeat"), moe_layers_per_rank=1).ep
    assert split.bytes == pytest.approx(repeat.bytes / 2)


def test_zero3_moves_one_and_a_half_times_the_zero2_volume():
    """ZeRO paper, Sec. 7: DP and ZeRO-2 move 2 Psi per rank, ZeRO-3 3 Psi. With fp16 (FSDP
    gathers fp32 parameters, reduces fp32 gradients) all volumes share one dtype."""
    psi = 1e9
    layout = Layout(dp=16, tp=8, micro_batch=1, global_batch=16, precision="fp16")
    dp = {
        z: step(V3, layout.with_(zero=z), NO_LATENCY, dense_params_per_rank=psi).dp
        for z in (0, 2, 3)
    }
    assert dp[0].bytes == 4 * psi  # one all-reduce: nccl size Psi, 2 Psi on the wire
    assert dp[2].bytes == 8 * psi  # all-gather Psi + reduce-scatter Psi
    assert dp[3].bytes == 12 * psi  # + the backward all-gather
    assert dp[2].seconds == pytest.approx(dp[0].seconds)
    assert dp[3].seconds == pytest.approx(1.5 * dp[2].seconds)
    bf16 = step(V3, layout.with_(zero=3, precision="bf16"), dense_params_per_rank=psi).dp
    assert bf16.bytes == 2 * 2 * psi + 4 * psi  # bf16 gathers, fp32 gradients


def test_zero2_communicates_every_micro_batch_zero1_and_ddp_once_per_step():
    psi, layout = 1e9, Layout(dp=16, tp=8, micro_batch=1, global_batch=64)  # 4 micro-batches
    # DDP: an all-reduce of fp32 gradients. ZeRO-1: one all-gather of bf16 weights and one
    # reduce-scatter of fp32 gradients per step; ZeRO-2 both per micro-batch.
    assert step(V3, layout.with_(zero=0), dense_params_per_rank=psi).dp.bytes == 4 * psi
    assert step(V3, layout.with_(zero=1), dense_params_per_rank=psi).dp.bytes == 6 * psi
    assert step(V3, layout.with_(zero=2), dense_params_per_rank=psi).dp.bytes == 4 * 6 * psi
    # Under PP upstream's stages defer ZeRO-2's sync to the last micro-batch too.
    piped = layout.with_(zero=2, pp=2)
    assert step(V3, piped, dense_params_per_rank=psi).dp.bytes == 6 * psi


def test_gradient_reduction_hides_behind_backward_except_the_last_bucket():
    psi, layout = 1e9, Layout(dp=16, tp=8, zero=0, micro_batch=1, global_batch=16)
    bare = step(V3, layout, dense_params_per_rank=psi).dp
    assert bare.exposed_seconds == bare.seconds
    hidden = step(V3, layout, dense_params_per_rank=psi, backward_compute_s=100.0).dp
    buckets = math.ceil(4 * psi / 2**20 / 25)
    assert hidden.exposed_seconds == pytest.approx(bare.seconds / buckets)

    fsdp = layout.with_(zero=3)
    bare = step(V3, fsdp, dense_params_per_rank=psi, layers_per_rank=4).dp
    assert bare.exposed_seconds == pytest.approx(bare.seconds)
    busy = dict(forward_compute_s=100.0, backward_compute_s=100.0)
    hidden = step(V3, fsdp, dense_params_per_rank=psi, layers_per_rank=4, **busy).dp
    assert 0 < hidden.exposed_seconds < bare.seconds / 4  # one block's reduce-scatter


def test_experts_reduce_over_their_own_group_in_the_backward_the_dense_ones_leave():
    # fp16: FSDP gathers fp32 parameters, so a gather costs what a reduce-scatter costs.
    layout = Layout(dp=16, tp=8, ep=8, zero=2, micro_batch=1, global_batch=16, precision="fp16")
    kwargs = dict(
        layers_per_rank=4,
        moe_layers_per_rank=4,
        dense_params_per_rank=1e9,
        expert_params_per_rank=1e9,
    )
    bare = step(V3, layout, **kwargs)
    assert bare.edp.group_size == 16 and bare.edp.link == "inter"
    assert bare.edp.exposed_seconds == bare.edp.seconds
    reduce = bare.dp.seconds / 2  # the dense reduce-scatters: all of the dense backward comm
    tight = step(V3, layout, backward_compute_s=reduce, **kwargs)
    assert tight.dp.exposed_seconds == pytest.approx(bare.dp.seconds / 2 + reduce / 4)
    assert tight.edp.exposed_seconds == pytest.approx(bare.edp.exposed_seconds)
    spare = reduce / 2  # the experts' reduce-scatters (same size, same group) hide this much
    roomier = step(V3, layout, backward_compute_s=reduce + spare, **kwargs)
    last_block = reduce / 4
    assert roomier.edp.exposed_seconds == pytest.approx(bare.edp.seconds - spare + last_block)


def test_without_ep_the_experts_are_dense_parameters_and_under_offload_outside_fsdp():
    layout = Layout(dp=16, tp=8, zero=0, micro_batch=1, global_batch=16)
    out = step(V3, layout, dense_params_per_rank=1e9, expert_params_per_rank=2e9)
    assert out.dp.bytes == 4 * 3e9 and out.edp.bytes == 0.0

    offload = layout.with_(ep=8, zero=2, offload=True)
    busy = dict(forward_compute_s=1e3, backward_compute_s=1e3, moe_layers_per_rank=4)
    edp = step(V3, offload, expert_params_per_rank=1e9, **busy).edp
    assert edp.bytes == 4e9  # one fp32 all-reduce after backward (`reduce_expert_grads`)
    assert edp.exposed_seconds == edp.seconds


def test_pp_sends_one_activation_and_one_gradient_per_micro_batch_and_chunk():
    layout = Layout(dp=8, pp=4, micro_batch=2, global_batch=64, seq_len=1024)  # 4 micro-batches
    pp = step(V3, layout).pp
    assert pp.bytes == 2 * 4 * 2 * 1024 * 7168 * 2
    assert pp.group_size == 4 and pp.link == "inter" and pp.exposed_seconds == pp.seconds
    interleaved = step(V3, layout.with_(schedule="interleaved-1f1b", virtual_stages=2)).pp
    assert interleaved.bytes == 2 * pp.bytes


def test_cp_in_dstrain_gathers_the_latent_exposed():
    """dstrain's trainer: one all-gather of the 576-value latent of the whole sequence per block
    and micro-batch, one reduce-scatter of its gradient; a third call under full recompute."""
    layout = Layout(dp=2, cp=4, micro_batch=1, global_batch=2, seq_len=8192)
    cp = step(V3, layout).cp
    latent = V3.kv_lora_rank + V3.qk_rope_head_dim
    assert cp.bytes == 2 * 8192 * latent * 2
    assert cp.exposed_seconds == cp.seconds > 0
    assert step(V3, layout, attention_compute_s=1e3).cp.exposed_seconds == cp.seconds
    recompute = step(V3, layout.with_(recompute="full")).cp
    assert recompute.bytes == 3 * 8192 * latent * 2
    ring = step(V3, layout.with_(engine="megatron")).cp
    print(f"cp4 at 8K, one V3 block: latent gather {cp.bytes / 2**20:.1f} MiB, ring "
          f"{ring.bytes / 2**20:.1f} MiB")  # fmt: skip
    assert ring.bytes > 50 * cp.bytes


def test_cp_ring_attention_hides_behind_attention():
    layout = Layout(dp=2, cp=4, micro_batch=1, global_batch=2, seq_len=8192, engine="megatron")
    cp = step(V3, layout).cp
    heads = V3.num_heads * (V3.qk_nope_head_dim + V3.qk_rope_head_dim + V3.v_head_dim)
    assert cp.bytes == 3 * 3 * (8192 / 4) * heads * 2  # (cp-1) hops, forward + 2x backward
    assert cp.exposed_seconds == cp.seconds
    assert step(V3, layout, attention_compute_s=1e3).cp.exposed_seconds == 0.0


def test_totals_and_json():
    layout = Layout(dp=16, tp=8, pp=2, ep=8, micro_batch=1, global_batch=64)
    out = step(V3, layout, moe_layers_per_rank=1, dense_params_per_rank=1e8)
    doc = out.to_json()
    assert list(doc) == list(AXES)
    assert set(doc["tp"]) == {
        "bytes", "seconds", "exposed_seconds", "link", "group_size", "algorithm"
    }  # fmt: skip
    assert out.exposed_seconds == pytest.approx(sum(a["exposed_seconds"] for a in doc.values()))
    assert doc["cp"] == {
        "bytes": 0.0,
        "seconds": 0.0,
        "exposed_seconds": 0.0,
        "link": "none",
        "group_size": 1,
        "algorithm": "none",
    }


def test_no_micro_batch_is_an_error():
    with pytest.raises(ValueError, match="global_batch"):
        step(V3, Layout(dp=64, micro_batch=2, global_batch=64))


def test_per_call_time_is_printed():
    layout = Layout(dp=64, tp=2, pp=16, ep=64, cp=2, zero=3, global_batch=4096)
    kwargs = dict(
        layers_per_rank=4,
        moe_layers_per_rank=4,
        dense_params_per_rank=5e8,
        expert_params_per_rank=7e8,
    )
    c, calls = cluster(4096), 2000
    first = comm_per_step(V3, layout, c, CONSTS, **kwargs)
    start = time.perf_counter()
    for _ in range(calls):
        again = comm_per_step(V3, layout, c, CONSTS, **kwargs)
    print(f"comm_per_step: {(time.perf_counter() - start) / calls * 1e6:.1f} us per call")
    assert again == first  # a pure function of its inputs: the search may call it in any order
