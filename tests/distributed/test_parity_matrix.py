"""The parity matrix: every layout against one process (DDP, ZeRO-1/2/3, CPU offload, HSDP, TP,
TP + SP, EP, and their combinations). ZeRO-1 (FSDP2 with the gradient sync deferred to the last of
each rank's 2 micro-batches) at dp2, dp4 and dp2 x ep2; pp2 x dp2 with DualPipeV in the pipeline
tests.

Every layout trains the debug flavor for 8 steps from the same weights on the same global batch
(16 sequences: 4 micro-batches of 4 on one process, 2 of 4 on each of 2 ranks). Per-step losses
must match the one-process run within 1e-5 relative, and the final weights too, and so must the
validation loss (eval.*: one held-out batch at steps 4 and 8, under PP the schedule's `eval`).

Clipping engages at every step: the global gradient norm of this run is 0.61-0.72 and the bound
0.25, so a norm mis-reduced over any mesh (FSDP, TP, EP, PP, CP) clips by the wrong factor. AdamW
all but ignores that factor (its update is g / sqrt(v)), so each step's `optim/grad_norm`, the
norm the step clipped by, must itself match the one-process run's within GRAD_NORM_RTOL.
"""

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from dstrain.config.load import load_config
from dstrain.train.trainer import Trainer
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

STEPS = 8
LOSS_RTOL = 1e-6  # the issue asks 1e-5; measured 6.4e-8 (1.3e-7 with AVX2 kernels)
# Final weights after 8 AdamW steps: Adam's update ~ lr * g / (|g| + eps) turns the ~1e-7
# relative differences of summing gradients in another order into larger ones for entries whose
# gradient is near eps. Measured up to 1.6e-6 with AVX512 kernels, and up to 3.0e-6 (TP layouts)
# with ATen's and oneDNN's AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`, as
# on the AVX2-only CI kind), whose vector width sums in another order.
WEIGHT_ATOL = 5e-6
GRAD_CLIP = 0.25  # below every step's norm (0.61-0.72): the clipping multiply runs every step
# Step 1 (identical weights) agrees to ~1e-7 in every layout; later steps inherit the weights'
# differences, most under sequence parallelism: measured up to 6.4e-6 (tp2 + SP), 1e-7-2e-7
# elsewhere (the same with AVX2 kernels). An unreduced norm is off by tens of percent.
GRAD_NORM_RTOL = 2e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py")):
        (corpus / f"{source.parent.name}_{source.stem}.txt").write_text(source.read_text())
    held_out = root / "validation"  # files of their own: the training batches stay as they were
    held_out.mkdir()
    for source in sorted((stdlib / "http").glob("*.py")):
        (held_out / f"http_{source.stem}.txt").write_text(source.read_text())
    common = [
        f"data.source={corpus}",
        f"data.cache_dir={root / 'cache'}",
        f"run.root={root / 'runs'}",
        f"train.steps={STEPS}",
        "train.seq_len=32",
        "train.micro_batch_size=4",
        "train.global_batch_size=16",
        "lr.warmup_steps=2",
        f"train.grad_clip={GRAD_CLIP}",
        "metrics.log_interval=1",
        "metrics.tensorboard=false",
        "checkpoint.enable=false",
        f"eval.source={held_out}",  # validation, on the same held-out batch in every layout
        "eval.interval=4",
        "eval.steps=1",
    ]
    reference = Trainer(load_config(None, [*common, "run.name=reference"]).config)
    reference.train()
    return root, common, reference.model.state_dict()


def _losses(root: Path, name: str, key: str = "loss/main") -> list[float]:
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [line[key] for line in map(json.loads, lines) if key in line]


def _check(
    root: Path,
    name: str,
    reference_weights: dict,
    weights_dir: Path | None = None,
    reference: str = "reference",
    weight_atol: float = WEIGHT_ATOL,
) -> None:
    expected, got = _losses(root, reference), _losses(root, name)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(expected, got, strict=True), start=1):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (name, step, a, b)
    held_out = _losses(root, reference, "eval/loss"), _losses(root, name, "eval/loss")
    if held_out[0]:  # evaluated at steps 4 and 8: the same held-out loss in every layout
        assert len(held_out[1]) == len(held_out[0]) == 2, (name, held_out)
        for a, b in zip(*held_out, strict=True):
            assert abs(a - b) <= LOSS_RTOL * abs(a), (name, "eval/loss", a, b)
    norms = _losses(root, reference, "optim/grad_norm"), _losses(root, name, "optim/grad_norm")
    assert len(norms[1]) == STEPS and min(norms[0]) > GRAD_CLIP, (name, norms)
    norm_rel = max(abs(a - b) / a for a, b in zip(*norms, strict=True))
    assert norm_rel <= GRAD_NORM_RTOL, (name, "optim/grad_norm", norms)
    weights = torch.load((weights_dir or root) / f"{name}.pt")
    assert weights.keys() == reference_weights.keys(), name
    worst = max((weights[k] - reference_weights[k]).abs().max().item() for k in weights)
    assert worst < weight_atol, (name, worst)
    rel = max(abs(a - b) / abs(a) for a, b in zip(expected, got, strict=True))
    print(
        f"parity {name}: max loss rel diff {rel:.1e}, max weight diff {worst:.1e}, "
        f"max grad norm rel diff {norm_rel:.1e}"
    )


TWO_RANKS = {
    "ddp": ["parallel.dp_shard=2", "parallel.zero_stage=0"],
    "zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
    "zero2": ["parallel.dp_shard=2", "parallel.zero_stage=2"],
    "zero3": ["parallel.dp_shard=2", "parallel.zero_stage=3"],
    "zero3_offload": [
        "parallel.dp_shard=2",
        "parallel.zero_stage=3",
        "parallel.offload_optimizer=true",
        "parallel.offload_params=true",
    ],
}


# Compression changes the maths: each run is held to DDP's per-step losses within its own bound,
# and must differ from them (a run whose compression was off would match DDP to ~1e-7). What the
# bounds guard: training moves this run's loss by 3.3 % over the 8 steps (7.65 -> 7.40).
# fp16 hook: measured 1.7e-5 (AVX512 and AVX2 kernels), bound 1e-4. PowerSGD rank 2: measured
# 7.4e-3, bound 1.5e-2, below half of training's 3.3 %.
COMPRESSED = {
    "fp16_hook": ["parallel.dp_shard=2", "parallel.zero_stage=0", "comm.compression=fp16"],
    "powersgd": [
        "parallel.dp_shard=2",
        "parallel.zero_stage=0",
        "comm.compression=powersgd",
        "comm.powersgd_rank=2",
        "comm.powersgd_start_iter=2",
    ],
}
COMPRESSED_RTOL = {"fp16_hook": (1e-6, 1e-4), "powersgd": (1e-3, 1.5e-2)}  # (at least, at most)


def test_two_rank_layouts_match_one_process(setup):
    root, common, reference = setup
    spec = {"common": common, "layouts": {**TWO_RANKS, **COMPRESSED}}
    run_ranks(2, "train_layouts", root, json.dumps(spec), timeout=600)
    for name in TWO_RANKS:
        _check(root, name, reference)
    exact = _losses(root, "ddp")
    for name in COMPRESSED:
        got = _losses(root, name)
        worst = max(abs(a - b) / a for a, b in zip(exact, got, strict=True))
        print(f"convergence {name}: max loss rel diff to DDP {worst:.1e}")
        low, high = COMPRESSED_RTOL[name]
        assert low < worst <= high, (name, worst)
        assert got[-1] < got[0], name  # still learning


def test_hsdp_2x2_matches_one_process(setup):
    root, common, reference = setup
    layouts = {"hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero_stage=3"]}
    run_ranks(
        4, "train_layouts", root, json.dumps({"common": common, "layouts": layouts}), timeout=600
    )
    _check(root, "hsdp", reference)


# Tensor and expert parallelism, alone and combined, on 2 ranks.
TWO_RANKS_ND = {
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2_ddp": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=0"],
    "ep2_fsdp": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=2"],
    "ep2_zero1": ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero_stage=1"],
    "tp2_ep2": ["parallel.tp=2", "parallel.ep=2"],
}
FOUR_RANKS_ND = {
    "dp4_zero1": ["parallel.dp_shard=4", "parallel.zero_stage=1"],
    "dp2_tp2": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.zero_stage=2"],
    "dp4_ep2": ["parallel.dp_shard=4", "parallel.ep=2", "parallel.zero_stage=3"],
    "hsdp_ep2": [
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.zero_stage=3",
    ],
}


def test_tensor_and_expert_parallel_match_one_process(setup):
    root, common, reference = setup
    spec = {"common": common, "layouts": TWO_RANKS_ND}
    run_ranks(2, "train_layouts", root / "nd2", json.dumps(spec), timeout=600)
    for name in TWO_RANKS_ND:
        _check(root, name, reference, weights_dir=root / "nd2")


def test_combined_layouts_on_four_ranks_match_one_process(setup):
    root, common, reference = setup
    spec = {"common": common, "layouts": FOUR_RANKS_ND}
    run_ranks(4, "train_layouts", root / "nd4", json.dumps(spec), timeout=600)
    for name in FOUR_RANKS_ND:
        _check(root, name, reference, weights_dir=root / "nd4")


# Context parallelism (issue 32): each cp rank trains on two chunks of every sequence; the
# weights are sharded over dp_shard x cp (ZeRO; under HSDP inside each replica) or replicated
# (DDP over dp x cp). Against the one-process run without MTP (MTP under cp: `CP_MTP` below).
NO_MTP = ["model.num_mtp_modules=0"]
# The gathered latents change the order in which attention sums over keys, and a cp rank's
# gradient adds up its own and the other ranks' queries' contributions: after 8 AdamW steps
# (see WEIGHT_ATOL) the final weights differ by up to 7.2e-6 at cp 4 (AVX512 kernels); the
# per-step losses still match within LOSS_RTOL.
CP_WEIGHT_ATOL = 2e-5
CP_TWO_RANKS = {
    "cp2_ddp": ["parallel.cp=2", "parallel.zero_stage=0"],
    "cp2_zero1": ["parallel.cp=2", "parallel.zero_stage=1"],
    "cp2_zero3": ["parallel.cp=2", "parallel.zero_stage=3"],
    # experts borrow their ranks from dp_shard x cp x tp: here ep2 over the two cp ranks
    "cp2_ep2": ["parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1"],
    "cp2_ep2_zero3": ["parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=3"],
}
CP_FOUR_RANKS = {
    "cp4": ["parallel.cp=4", "parallel.zero_stage=1"],
    "dp2_cp2_zero1": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=1"],
    "dp2_cp2_zero3": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=3"],
    "cp2_tp2": ["parallel.cp=2", "parallel.tp=2"],
    "cp2_tp2_sp": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2_cp2_ep2": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"],
    # HSDP: the two cp ranks shard the weights, the two replicas all-reduce
    "hsdp2_cp2_zero3": ["parallel.dp_replicate=2", "parallel.cp=2", "parallel.zero_stage=3"],
}


@pytest.fixture(scope="module")
def cp_reference(setup):
    root, common, _ = setup
    reference = Trainer(load_config(None, [*common, *NO_MTP, "run.name=reference_no_mtp"]).config)
    reference.train()
    return reference.model.state_dict()


def test_context_parallel_layouts_match_one_process(setup, cp_reference):
    root, common, _ = setup
    for ranks, layouts in ((2, CP_TWO_RANKS), (4, CP_FOUR_RANKS)):
        spec = {"common": [*common, *NO_MTP], "layouts": layouts}
        run_ranks(ranks, "train_layouts", root / f"cp{ranks}", json.dumps(spec), timeout=600)
        for name in layouts:
            _check(
                root, name, cp_reference, root / f"cp{ranks}", "reference_no_mtp", CP_WEIGHT_ATOL
            )


# MTP under context parallelism: each depth keeps the split sequence's positions, its input
# tokens and targets shifted before the split (torchtitan refuses MTP with CP).
CP_MTP = {
    "cp2_mtp": ["parallel.cp=2", "parallel.zero_stage=1"],
    "cp2_mtp_zero3": ["parallel.cp=2", "parallel.zero_stage=3"],
}


# The balance loss under context parallelism (V3's sequence-wise form, with MTP, whose padded
# positions it leaves out): its statistics summed over the cp group, its backward scaled by cp.
AUX = ["model.aux_loss_alpha=0.01"]
CP_AUX = {
    "cp2_aux_zero1": ["parallel.cp=2", "parallel.zero_stage=1"],
    "cp2_aux_ddp": ["parallel.cp=2", "parallel.zero_stage=0"],
    # recomputed blocks must see what their forward saw: MTP's padded positions are known to
    # its MoE by position, not set around the call (a recompute ran without them once)
    "cp2_aux_selective": ["parallel.cp=2", "train.activation_checkpoint=selective"],
    "cp2_aux_full": ["parallel.cp=2", "train.activation_checkpoint=full"],
}


def test_context_parallel_with_the_balance_loss_matches_one_process(setup):
    root, common, _ = setup
    reference = Trainer(load_config(None, [*common, *AUX, "run.name=reference_aux"]).config)
    reference.train()
    weights = reference.model.state_dict()
    spec = {"common": [*common, *AUX], "layouts": CP_AUX}
    run_ranks(2, "train_layouts", root / "cp_aux", json.dumps(spec), timeout=600)
    for name in CP_AUX:
        _check(root, name, weights, root / "cp_aux", "reference_aux", CP_WEIGHT_ATOL)


def test_context_parallel_with_mtp_matches_one_process(setup):
    root, common, reference = setup
    spec = {"common": common, "layouts": CP_MTP}
    run_ranks(2, "train_layouts", root / "cp_mtp", json.dumps(spec), timeout=600)
    for name in CP_MTP:
        _check(root, name, reference, root / "cp_mtp", weight_atol=CP_WEIGHT_ATOL)
        assert _losses(root, name, "loss/mtp") == pytest.approx(
            _losses(root, "reference", "loss/mtp"), rel=LOSS_RTOL
        ), name
