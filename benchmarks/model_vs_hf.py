"""Our model vs transformers' DeepseekV3ForCausalLM: training throughput on the same weights.

Side by side in one run, on CPU in fp32, for two shapes without MTP (HF has none):

- debug: the debug flavor, batch 8 x seq 128;
- wide: the debug flavor at twice the width and depth (dim 256, 8 layers, 8 heads, inter_dim 768,
  moe_inter_dim 128, q_lora_rank 128, kv_lora_rank 64; 8 experts, top-2), batch 8 x seq 256.

Our model is built with `build_model`, exported with `save_hf_checkpoint` and loaded by
`DeepseekV3ForCausalLM.from_pretrained` (config from `hf_config`, `attn_implementation="sdpa"`, HF's
fastest on CPU; its experts use its default, `grouped_mm`). Logits must agree within 1e-4 before
anything is timed. One step is forward, `F.cross_entropy`, backward, `AdamW.step` (same lr, foreach)
and `zero_grad`, written once and run on both models with the same token batches.

Steps alternate (ours, HF, HF, ours, ...) so drift on a shared machine hits both alike; tok/s come
from the median step time, and the ratio is the median over rounds of HF's step time / ours in the
same round. One intra-op thread by default: on a shared 2-core machine a second thread mostly
measures the neighbours (steps then vary 5x from one to the next); `--threads 2` to try anyway.

Usage: python benchmarks/model_vs_hf.py [--repeats R] [--threads T]
"""

import argparse
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

from dstrain.config.flavors import FLAVORS
from dstrain.config.model_args import ModelArgs
from dstrain.model.hf_adapter import hf_config, save_hf_checkpoint
from dstrain.model.transformer import build_model

TARGET = 1.5
LR = 1e-3
WIDE = dict(
    dim=256,
    num_layers=8,
    num_heads=8,
    inter_dim=768,
    moe_inter_dim=128,
    q_lora_rank=128,
    kv_lora_rank=64,
    max_seq_len=256,
    original_seq_len=256,
)
# name -> (ModelArgs overrides on the debug flavor, batch, seq)
SHAPES: dict[str, tuple[dict, int, int]] = {"debug": ({}, 8, 128), "wide": (WIDE, 8, 256)}


def hf_model_config(args: ModelArgs) -> transformers.DeepseekV3Config:
    """DeepseekV3Config from our config.json dict, dropping any key this version rejects."""
    cfg = hf_config(args)
    while True:
        try:
            return transformers.DeepseekV3Config(**cfg)
        except TypeError as exc:
            match = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            if match is None or match.group(1) not in cfg:
                raise
            del cfg[match.group(1)]


def build_pair(args: ModelArgs, experts: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ours = build_model(args)
    with tempfile.TemporaryDirectory() as folder:
        save_hf_checkpoint(ours.state_dict(), args, Path(folder))
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
            folder,
            config=hf_model_config(args),
            attn_implementation="sdpa",
            experts_implementation=experts,
        )
    return ours.train(), hf.train()


def max_logit_diff(ours: torch.nn.Module, hf: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(tokens) - hf(tokens, use_cache=False).logits).abs().max().item()


def stepper(
    forward: Callable[[torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    batches: list[torch.Tensor],
) -> Callable[[], float]:
    """A function that runs one training step on the next batch and returns its seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    position = 0

    def step() -> float:
        nonlocal position
        tokens = batches[position % len(batches)]
        position += 1
        start = time.perf_counter()
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def bench(name: str, repeats: int, experts: str) -> tuple[str, float, float, float]:
    overrides, batch, seq = SHAPES[name]
    args = FLAVORS["debug"].model_copy(update={**overrides, "num_mtp_modules": 0})
    ours, hf = build_pair(args, experts)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab_size, (batch, seq + 1), generator=gen) for _ in range(4)]
    diff = max_logit_diff(ours, hf, batches[0][:, :-1])
    impl = f"{hf.config._attn_implementation}/{hf.config._experts_implementation}"
    print(
        f"sanity {name}: max |logits ours - HF| = {diff:.1e} (limit 1e-4); HF attn/experts {impl}"
    )
    if diff > 1e-4:
        raise SystemExit(f"{name}: the models disagree; timing them would compare different maths")
    run_ours = stepper(ours, ours, batches)
    run_hf = stepper(lambda x: hf(x, use_cache=False).logits, hf, batches)
    for _ in range(2):  # warm-up: allocator, optimizer state, first-call dispatch
        run_ours(), run_hf()
    t_ours, t_hf = [], []
    for r in range(repeats):
        if r % 2:
            t_hf.append(run_hf())
            t_ours.append(run_ours())
        else:
            t_ours.append(run_ours())
            t_hf.append(run_hf())
    tokens = batch * seq
    ratio = statistics.median(h / o for h, o in zip(t_hf, t_ours, strict=True))
    label = f"{name} (dim {args.dim}, {args.num_layers} layers) {batch} x {seq}"
    return label, tokens / statistics.median(t_ours), tokens / statistics.median(t_hf), ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved steps per model")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--hf-experts",
        nargs="+",
        choices=["grouped_mm", "eager"],
        default=["grouped_mm", "eager"],
        help="HF experts implementations to compare with: grouped_mm (its default in "
        "transformers 5) and eager (its reference loop over experts)",
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rows = [
        (experts, *bench(name, args.repeats, experts))
        for experts in args.hf_experts
        for name in args.shapes
    ]
    print(
        f"CPU fp32, {args.threads} threads, AdamW lr {LR}, transformers {transformers.__version__} "
        f"(sdpa attention), median of {args.repeats} interleaved steps"
    )
    header = f"{'HF experts':<11} {'shape':<38} {'ours tok/s':>11} {'HF tok/s':>10} {'ours/HF':>8}"
    print(f"  {header}")
    for experts, label, ours, hf, ratio in rows:
        verdict = "ok" if ratio >= TARGET else f"below the {TARGET}x target"
        print(f"  {experts:<11} {label:<38} {ours:11,.0f} {hf:10,.0f} {ratio:7.2f}x  {verdict}")


if __name__ == "__main__":
    main()
