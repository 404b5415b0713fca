"""The prepared GPU check: what a machine with CUDA GPUs can confirm in about 5 minutes that a
CPU-only machine cannot, in one summary table.

1. `dstrain doctor --json` (versions, GPUs, topology, NCCL env).
2. One GPU: a bf16 run of a DeepSeek-style proxy of about 1B parameters (MLA, DeepSeekMoE with
   shared and routed experts, MTP), 30 steps: tokens/s, MFU, peak memory.
3. Two or more GPUs: `dstrain bench comm` (NCCL bus bandwidth), then NCCL runs of the layouts the
   GPU count fits (dp2 ZeRO-1, dp2 ZeRO-2, tp2, dp2 x ep2, pp2 1F1B; 4 GPUs add pp2 x dp2 x ep2
   DualPipeV ZeRO-1), each checked with `dstrain loss-compare` against one GPU, in fp32 with TF32
   off (bitwise-comparable numerics), and one bf16 dp2 x ep2 run.
4. The metrics of those runs: the CUDA-event comm spans (`comm/*`) and the GPU memory keys
   (`memory/peak_allocated_mb`, `memory/peak_reserved_mb`) present in metrics.jsonl.
5. Document masking's CUDA kernel: FlexAttention with a BlockMask against SDPA with the boolean
   mask (logits and gradients), and a short masked training run.
6. FP8: cuBLASLt's blockwise `scaled_mm` (1x128 x 128x128 and 1x128 x 1x128, SM90) against the
   plain-torch emulation on the same quantised operands, shapes that 128 does and does not
   divide; its speed against a bf16 matmul; and a short fp8 training run (`train.precision=fp8`)
   with its backend. On another GPU the kernel check reports why it cannot run.

    python benchmarks/gpu_check.py [--out DIR] [--steps 30]
    python benchmarks/gpu_check.py --smoke      # the same plumbing on CPU, tiny, ~2 minutes

Exits 1 when a check fails. `scripts/gpu-check.sh` runs it after installing the package.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROXY_1B = [  # ~1.0B parameters, ~0.3B activated
    "model.flavor=debug",
    "model.dim=1536",
    "model.num_layers=12",
    "model.num_heads=12",
    "model.q_lora_rank=384",
    "model.kv_lora_rank=256",
    "model.qk_nope_head_dim=64",
    "model.qk_rope_head_dim=32",
    "model.v_head_dim=64",
    "model.inter_dim=4096",
    "model.moe_inter_dim=512",
    "model.num_routed_experts=32",
    "model.num_activated_experts=4",
    "model.num_shared_experts=1",
    "model.n_group=4",
    "model.topk_group=2",
    "model.vocab_size=32768",
    "model.max_seq_len=4096",
]
LAYOUTS_2 = {
    "dp2_zero1": ["parallel.dp_shard=2", "parallel.zero_stage=1"],
    "dp2_zero2": ["parallel.dp_shard=2", "parallel.zero_stage=2"],
    "tp2": ["parallel.tp=2"],
    "dp2_ep2": ["parallel.dp_shard=2", "parallel.ep=2"],
    "pp2_1f1b": ["parallel.pp=2"],
}
LAYOUTS_4 = {
    "pp2_dp2_ep2_dualpipev_zero1": [
        "parallel.pp=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.zero_stage=1",
        "parallel.pp_schedule=dualpipev",
        "parallel.num_virtual_stages=2",
    ]
}
GPU_KEYS = ("memory/peak_allocated_mb", "memory/peak_reserved_mb")


def dstrain(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dstrain", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.failed = False

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        verdict = "ok" if ok else ("FAIL" if ok is False else "skip")
        self.failed |= ok is False
        self.rows.append((check, verdict, detail))
        print(f"  {verdict:4} {check}: {detail}", flush=True)

    def show(self) -> None:
        width = max(len(r[0]) for r in self.rows)
        print("\n" + "=" * 100)
        for check, verdict, detail in self.rows:
            print(f"{check:<{width}}  {verdict:4}  {detail}")


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def metric_keys(run: Path) -> set[str]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return set().union(*(json.loads(line) for line in lines)) if lines else set()


def check_doctor(table: Table) -> None:
    done = dstrain("doctor", "--json")
    try:
        report = json.loads(done.stdout)
        statuses = [c.get("status") for c in report.get("checks", report)]
        table.add(
            "doctor",
            done.returncode in (0, 1),
            f"exit {done.returncode}, {statuses.count('fail')} fail, {statuses.count('warn')} warn",
        )
    except (ValueError, AttributeError):
        table.add("doctor", False, f"exit {done.returncode}: {done.stderr.strip()[-200:]}")


def check_proxy(table: Table, out: Path, steps: int, smoke: bool) -> None:
    model = ["model.flavor=debug"] if smoke else PROXY_1B
    precision = "fp32" if smoke else "bf16"
    common = [
        f"run.root={out}",
        f"train.steps={steps}",
        "train.seq_len=128" if smoke else "train.seq_len=2048",
    ]
    common += ["train.micro_batch_size=4", "metrics.log_interval=5", "checkpoint.enable=false"]
    began = time.perf_counter()
    done = dstrain(
        "train",
        "--fresh",
        *sets([*model, *common, f"train.precision={precision}", "run.name=proxy"]),
        timeout=1200,
    )
    if done.returncode != 0:
        table.add("1-GPU proxy", False, done.stderr.strip()[-300:])
        return
    s = summary(out / "proxy")
    peak = s.get("peak_gpu_allocated_mb")
    memory = "n/a" if peak is None else f"{peak:,.0f} MB"
    figures = f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}%"
    took = time.perf_counter() - began
    table.add(
        "1-GPU proxy",
        True,
        f"{precision}, {figures} ({s['mfu_against']}), peak allocated {memory}, {took:.0f} s",
    )
    keys = metric_keys(out / "proxy")
    if not smoke:
        missing = [k for k in GPU_KEYS if k not in keys]
        table.add(
            "GPU memory keys", not missing, "present" if not missing else f"missing {missing}"
        )


def check_layouts(table: Table, out: Path, gpus: int, smoke: bool) -> None:
    common = [f"run.root={out}", "train.steps=8", "train.seq_len=128", "train.micro_batch_size=4"]
    common += ["train.global_batch_size=16", "metrics.log_interval=1", "checkpoint.enable=false"]
    common += ["train.precision=fp32", "lr.warmup_steps=2"]
    if not smoke:
        common += ["train.tf32=false"]  # true fp32: the layouts must match one GPU to ~1e-6
    reference = dstrain("train", "--fresh", *sets([*common, "run.name=one_gpu"]))
    if reference.returncode != 0:
        table.add("one-GPU reference", False, reference.stderr.strip()[-300:])
        return
    layouts = dict(LAYOUTS_2)
    if gpus >= 4:
        layouts |= {k: [*v, "train.micro_batch_size=2"] for k, v in LAYOUTS_4.items()}
    for name, overrides in layouts.items():
        ranks = 4 if name in LAYOUTS_4 else 2
        done = dstrain(
            "train",
            "--fresh",
            "--nproc",
            str(ranks),
            *sets([*common, *overrides, f"run.name={name}"]),
        )
        if done.returncode != 0:
            table.add(f"{ranks}-GPU {name}", False, done.stderr.strip()[-300:])
            continue
        compared = dstrain("loss-compare", str(out / "one_gpu"), str(out / name), "--rtol", "1e-5")
        keys = metric_keys(out / name)
        comm = sorted(k for k in keys if k.startswith("comm/") and k.endswith("exposed_fraction"))
        detail = (compared.stdout.strip().splitlines() or ["?"])[-1][:120]
        table.add(
            f"{ranks}-GPU {name} vs one GPU",
            compared.returncode == 0,
            f"{detail}; comm keys {len(comm)}",
        )
    bf16 = dstrain(
        "train",
        "--fresh",
        "--nproc",
        "2",
        *sets([*common, *LAYOUTS_2["dp2_ep2"], "train.precision=bf16", "run.name=dp2_ep2_bf16"]),
    )
    table.add(
        "2-GPU dp2 x ep2 bf16 trains",
        bf16.returncode == 0,
        "" if bf16.returncode == 0 else bf16.stderr.strip()[-300:],
    )


def check_document_mask(table: Table, out: Path, smoke: bool) -> None:
    """FlexAttention's BlockMask (the CUDA path of data.document_mask) against SDPA with the
    boolean mask (the CPU path, which the CPU tests prove right) on one model and batch: logits
    and gradients; then a short training run with the mask on."""
    import torch

    from dstrain.config.flavors import flavor_args
    from dstrain.model import documents
    from dstrain.model.transformer import build_model

    device = "cpu" if smoke else "cuda"
    model = build_model(flavor_args("debug"), device, seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (2, 256), generator=g).to(device)
    ids = torch.sort(torch.randint(0, 6, (2, 256), generator=g), dim=1).values.to(device)

    def run(flex: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        saved = list(documents._COMPILED_FLEX)
        if not flex:
            documents._COMPILED_FLEX[:] = [None]  # the SDPA path with a boolean mask
        try:
            model.zero_grad()
            logits = model(tokens, documents=ids)[0]
            logits.float().square().mean().backward()
        finally:
            documents._COMPILED_FLEX[:] = saved
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    try:
        (a, ga), (b, gb) = run(True), run(False)
        logit_gap = (a - b).abs().max().item()
        grad_gap = max(
            ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item()
            for x, y in zip(ga, gb, strict=True)
        )
        kind = "SDPA bool mask (CPU)" if smoke else "FlexAttention BlockMask vs SDPA bool mask"
        table.add(
            "document mask kernels",
            logit_gap < 1e-3 and grad_gap < 1e-2,
            f"{kind}: max |logits diff| {logit_gap:.1e}, max grad diff {grad_gap:.1e} of max",
        )
    except Exception as exc:  # a kernel that does not run here is a finding, not a crash
        table.add("document mask kernels", False, f"{type(exc).__name__}: {exc}"[:300])
    steps = ["train.steps=4", "train.seq_len=256", "train.micro_batch_size=2"]
    done = dstrain(
        "train",
        "--fresh",
        *sets([f"run.root={out}", "run.name=docmask", "data.document_mask=true", *steps]),
    )
    table.add(
        "document-masked run trains",
        done.returncode == 0,
        "" if done.returncode == 0 else done.stderr.strip()[-300:],
    )


def check_fp8(table: Table, out: Path, smoke: bool) -> None:
    """The blockwise kernel against the emulation (the CPU tests prove the emulation against
    fp64): same E4M3 operands and scales, so only accumulation order may differ."""
    import torch

    from dstrain.model import fp8

    device = torch.device("cpu" if smoke else "cuda")
    reason = fp8.blockwise_kernel_reason(device)
    backend = "emulated" if reason else "scaled_mm"
    worst = 0.0
    try:
        g = torch.Generator().manual_seed(0)
        for M, N, K in [(256, 768, 512), (200, 300, 130), (4096, 2048, 7168)][: 2 if smoke else 3]:
            x = (torch.randn(M, K, generator=g) ** 3).to(device)
            w = (torch.randn(N, K, generator=g) * 0.02).to(device)
            qx, qw, qt = fp8.quantize_tiles(x), fp8.quantize_blocks(w), fp8.quantize_tiles(w)
            for b in (qw, qt):
                got = fp8.blockwise_mm(qx, b, torch.float32, backend)
                ref = fp8.emulated_mm(qx, b)
                worst = max(worst, ((got - ref).norm() / ref.norm()).item())
        label = f"{backend}" + (f" ({reason})" if reason else "")
        table.add(
            "fp8 blockwise kernel vs emulation", worst < 1e-3, f"{label}: rel. diff {worst:.1e}"
        )
        if not reason:
            table.add("fp8 GEMM speed", None, _fp8_speed(device))
    except Exception as exc:  # a kernel that does not run here is a finding, not a crash
        table.add("fp8 blockwise kernel vs emulation", False, f"{type(exc).__name__}: {exc}"[:300])
    steps = ["train.steps=4", "train.precision=fp8"]
    if reason and not smoke:
        steps.append("train.fp8_backend=emulated")
    done = dstrain("train", "--fresh", *sets([f"run.root={out}", "run.name=fp8", *steps]))
    table.add(
        "fp8 run trains",
        done.returncode == 0,
        "" if done.returncode == 0 else done.stderr.strip()[-300:],
    )


def _fp8_speed(device) -> str:
    import torch

    from dstrain.model import fp8

    x = torch.randn(8192, 7168, device=device, dtype=torch.bfloat16)
    w = torch.randn(2048, 7168, device=device, dtype=torch.bfloat16)
    qx, qw = fp8.quantize_tiles(x), fp8.quantize_blocks(w)

    def best(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    gemm = best(lambda: fp8.blockwise_mm(qx, qw, torch.bfloat16, "scaled_mm"))
    bf16 = best(lambda: x @ w.T)
    whole = best(lambda: fp8.fp8_matmul(x, w, "scaled_mm"))
    return (
        f"8192x2048x7168: GEMM {bf16 / gemm:.2f}x bf16's speed; with quantisation "
        f"{bf16 / whole:.2f}x"
    )


def check_bench(table: Table, gpus: int) -> None:
    done = dstrain("bench", "comm", "--nproc", str(min(gpus, 8)), "--json", timeout=900)
    try:
        report = json.loads(done.stdout)
        busbw = report.get("avg_busbw", {})
        shown = ", ".join(f"{op} {bw:.0f}" for op, bw in busbw.items())
        table.add("bench comm (GB/s busbw)", done.returncode == 0, shown)
    except ValueError:
        table.add("bench comm", False, done.stderr.strip()[-300:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="the plumbing on CPU, tiny")
    args = parser.parse_args()
    gpus = gpu_count()
    if not gpus and not args.smoke:
        print("no CUDA GPU visible: nothing to check here (--smoke runs the plumbing on CPU)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    table = Table()
    print(f"gpu check: {gpus} GPU(s), results under {args.out}", flush=True)
    check_doctor(table)
    check_proxy(table, args.out, 6 if args.smoke else args.steps, args.smoke)
    check_document_mask(table, args.out, args.smoke)
    check_fp8(table, args.out, args.smoke)
    if gpus >= 2 or args.smoke:
        if not args.smoke:
            check_bench(table, gpus)
        check_layouts(table, args.out, max(gpus, 2), args.smoke)
    else:
        table.add("multi-GPU layouts", None, "one GPU: bench comm and the NCCL layouts need two")
    table.show()
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
