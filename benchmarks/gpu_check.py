"""The prepared GPU check: what a machine with CUDA GPUs can confirm in about 5 minutes that a
CPU-only machine cannot, in one summary table headed by torch, its CUDA, the GPU and the driver.

1. `dstrain doctor --json` (versions, GPUs, topology, NCCL env).
2. One GPU: a bf16 run of a DeepSeek-style proxy of about 1B parameters (MLA, DeepSeekMoE with
   shared and routed experts, MTP), 30 steps: tokens/s, MFU, peak memory.
3. The kernels, each against an independent reference on the same inputs (`gpu_check_kernels`):
   cuBLASLt's blockwise FP8 `scaled_mm` through the training code itself (`fp8_matmul` and the
   routed experts' `fp8_grouped_matmul`, forward and backward, whose wgrad hands the kernel
   transposed operands) against the exact emulation; bf16 `grouped_mm` (the experts' kernel)
   against a per-expert loop in fp32; FlexAttention's BlockMask against SDPA with the boolean
   mask; context parallelism's chunked attention with torch's bottom-right causal bias (fused
   kernels) against the same chunks under the explicit mask. Then the FP8 GEMM's speed against
   bf16 and a short `train.precision=fp8` run on it.
4. Two or more GPUs: `dstrain bench comm` (NCCL bus bandwidth), then NCCL runs of the layouts the
   GPU count fits (dp2 ZeRO-1, dp2 ZeRO-2, tp2, dp2 x ep2, pp2 1F1B, cp2 ZeRO-1; 4 GPUs add
   pp2 x dp2 x ep2 DualPipeV ZeRO-1), each checked with `dstrain loss-compare` against one GPU,
   in fp32 with TF32 off (bitwise-comparable numerics), and one bf16 dp2 x ep2 run; the
   CUDA-event comm spans (`comm/*`) and GPU memory keys in their metrics.jsonl.

A kernel row says "ok" only where its kernel ran and agreed with its reference. Where the kernel
cannot run (a CPU, another GPU, a torch built with too old a CUDA) the row says "skip" and why:
it is never compared with the fallback the training would take, which is its own reference.

    python benchmarks/gpu_check.py [--out DIR] [--steps 30]
    python benchmarks/gpu_check.py --kernels    # step 3 alone, about a minute on one GPU
    python benchmarks/gpu_check.py --smoke      # the same plumbing on CPU, tiny, ~1 minute

Writes DIR/gpu_check.json (the header and every row). Exits 1 when a row fails.
`scripts/gpu-check.sh` runs it with the machine's own CUDA build of torch.
"""

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing dstrain

from gpu_check_kernels import (  # noqa: E402
    FLEX,
    FP8,
    FP8_KERNEL,
    FP8_REFERENCE,
    check_kernels,
    flex_reason,
)

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
    # NCCL's all-gather and reduce-scatter of the latent, the bottom-right causal bias (MTP
    # and the balance loss's cp sums on)
    "cp2_zero1": ["parallel.cp=2", "parallel.zero_stage=1", "model.aux_loss_alpha=0.001"],
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
SMOKE_LAYOUTS = ("dp2_zero1", "pp2_1f1b")  # --smoke runs these; the others only `dstrain check`
GPU_KEYS = ("memory/peak_allocated_mb", "memory/peak_reserved_mb")


def dstrain(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dstrain", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def platform_facts() -> dict[str, str]:
    """What the table's numbers were measured on: torch, the CUDA it was built with
    (`torch.version.cuda`), the GPU, its compute capability and the driver; "none" where absent."""
    import torch

    from dstrain.doctor.gpus import probe

    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "gpu": "none",
        "capability": "none",
        "driver": probe().driver or "none",  # NVML, else nvidia-smi
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = f"{torch.cuda.device_count()} x {props.name}"
        facts["capability"] = f"{props.major}.{props.minor}"
    return facts


@dataclass
class Row:
    check: str
    verdict: str  # "ok", "FAIL", "skip" (did not run here, proves nothing) or "info"
    detail: str
    kernel: str | None = None  # the kernel a kernel row checks: "ok" only where it ran


class Table:
    def __init__(self, facts: dict[str, str]) -> None:
        self.facts = facts
        self.rows: list[Row] = []
        self.began = time.perf_counter()

    def add(self, check: str, ok: bool, detail: str, kernel: str | None = None) -> None:
        self._append(Row(check, "ok" if ok else "FAIL", detail, kernel))

    def skip(self, check: str, reason: str, kernel: str | None = None) -> None:
        self._append(Row(check, "skip", reason, kernel))

    def info(self, check: str, detail: str) -> None:
        self._append(Row(check, "info", detail))

    def _append(self, row: Row) -> None:
        self.rows.append(row)
        took = time.perf_counter() - self.began
        print(f"  [{took:4.0f} s] {row.verdict:4} {row.check}: {row.detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(r.verdict == "FAIL" for r in self.rows)

    def header(self) -> str:
        f = self.facts
        return (
            f"torch {f['torch']}, CUDA {f['cuda']}, GPU {f['gpu']} "
            f"(capability {f['capability']}), driver {f['driver']}"
        )

    def show(self) -> None:
        width = max(len(r.check) for r in self.rows)
        print("\n" + "=" * 100)
        print(self.header())
        for r in self.rows:
            print(f"{r.check:<{width}}  {r.verdict:4}  {r.detail}")
        counts = {v: sum(r.verdict == v for r in self.rows) for v in ("ok", "FAIL", "skip")}
        print(", ".join(f"{n} {v}" for v, n in counts.items()))
        for verdict, meaning in (("skip", "did not run here, proved nothing"), ("FAIL", "failed")):
            names = [r.check for r in self.rows if r.verdict == verdict]
            if names:
                print(f"{verdict} ({meaning}): " + "; ".join(names))

    def write_json(self, path: Path) -> None:
        rows = [asdict(r) for r in self.rows]
        path.write_text(json.dumps({"platform": self.facts, "rows": rows}, indent=1) + "\n")


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
    common = [f"run.root={out}", f"train.steps={steps}", "train.micro_batch_size=4"]
    common += ["metrics.log_interval=5", "checkpoint.enable=false"]
    if smoke:
        common += ["train.seq_len=64", "train.global_batch_size=4"]
    else:
        common.append("train.seq_len=2048")
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
    common = [f"run.root={out}", "train.micro_batch_size=4", "metrics.log_interval=1"]
    common += ["checkpoint.enable=false", "train.precision=fp32", "lr.warmup_steps=2"]
    if smoke:  # the plumbing only, at the smallest size that still accumulates gradients
        common += ["train.steps=4", "train.seq_len=64", "train.global_batch_size=8"]
    else:  # true fp32: the layouts must match one GPU to ~1e-6
        common += ["train.steps=8", "train.seq_len=128", "train.global_batch_size=16"]
        common += ["train.tf32=false"]
    reference = dstrain("train", "--fresh", *sets([*common, "run.name=one_gpu"]))
    if reference.returncode != 0:
        table.add("one-GPU reference", False, reference.stderr.strip()[-300:])
        return
    layouts = dict(LAYOUTS_2)
    if gpus >= 4:
        layouts |= {k: [*v, "train.micro_batch_size=2"] for k, v in LAYOUTS_4.items()}
    for name, overrides in layouts.items():
        ranks = 4 if name in LAYOUTS_4 else 2
        check = f"{ranks}-GPU {name} vs one GPU"
        if smoke and name not in SMOKE_LAYOUTS:
            checked = dstrain("check", "--world-size", str(ranks), *sets([*common, *overrides]))
            if checked.returncode != 0:
                table.add(check, False, checked.stdout.strip()[-300:])
            else:
                table.skip(check, f"smoke runs {' and '.join(SMOKE_LAYOUTS)}; this passed check")
            continue
        done = dstrain(
            "train",
            "--fresh",
            "--nproc",
            str(ranks),
            *sets([*common, *overrides, f"run.name={name}"]),
        )
        if done.returncode != 0:
            table.add(check, False, done.stderr.strip()[-300:])
            continue
        compared = dstrain("loss-compare", str(out / "one_gpu"), str(out / name), "--rtol", "1e-5")
        keys = metric_keys(out / name)
        comm = sorted(k for k in keys if k.startswith("comm/") and k.endswith("exposed_fraction"))
        detail = (compared.stdout.strip().splitlines() or ["?"])[-1][:120]
        table.add(check, compared.returncode == 0, f"{detail}; comm keys {len(comm)}")
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


def check_runs(table: Table, out: Path, device, smoke: bool) -> None:
    """`train.precision=fp8` on the blockwise kernel (on CPU, the smoke trains the emulation:
    plumbing only) and a document-masked run (FlexAttention on CUDA, else SDPA)."""
    from dstrain.model import fp8

    backend = FP8_REFERENCE if smoke else FP8_KERNEL
    check = f"fp8 run trains ({backend})"
    reason = None if smoke else fp8.blockwise_kernel_reason(device)
    short = ["train.steps=4"]
    if smoke:  # the plumbing only
        short = ["train.steps=2", "train.seq_len=64", "train.micro_batch_size=2"]
        short.append("train.global_batch_size=2")
    if reason is not None:
        table.skip(check, reason, FP8)
    else:
        overrides = [*short, "train.precision=fp8", f"train.fp8_backend={backend}"]
        table_run(table, check, out, overrides, None if smoke else FP8)
    flex = flex_reason(device) is None
    check = f"document-masked run trains ({'FlexAttention' if flex else 'SDPA bool mask'})"
    mask = ["data.document_mask=true"]
    if not smoke:
        mask += ["train.seq_len=256", "train.micro_batch_size=2"]
    table_run(table, check, out, [*short, *mask], FLEX if flex else None)


def table_run(
    table: Table, check: str, out: Path, overrides: list[str], kernel: str | None
) -> None:
    """A short training run; `kernel`: the kernel it runs on, where it is one of the checked."""
    name = check.split(" ")[0].replace("-", "_")
    common = [f"run.root={out}", f"run.name={name}", "checkpoint.enable=false"]
    done = dstrain("train", "--fresh", *sets([*common, *overrides]))
    ok = done.returncode == 0
    table.add(check, ok, "" if ok else done.stderr.strip()[-300:], kernel)


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
    parser.add_argument("--kernels", action="store_true", help="the kernel rows only (step 3)")
    args = parser.parse_args()
    import torch

    gpus = gpu_count()
    if not gpus and not args.smoke:
        print("no CUDA GPU visible: nothing to check here (--smoke runs the plumbing on CPU)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    table = Table(platform_facts())
    print(f"gpu check: {table.header()}; results under {args.out}", flush=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.kernels:
        check_kernels(table, device)
    else:
        check_all(table, args, gpus, device)
    table.show()
    table.write_json(args.out / "gpu_check.json")
    return 1 if table.failed else 0


def check_all(table: Table, args: argparse.Namespace, gpus: int, device) -> None:
    check_doctor(table)
    check_proxy(table, args.out, 2 if args.smoke else args.steps, args.smoke)
    check_kernels(table, device)
    check_runs(table, args.out, device, args.smoke)
    if gpus >= 2 or args.smoke:
        if not args.smoke:
            check_bench(table, gpus)
        check_layouts(table, args.out, max(gpus, 2), args.smoke)
    else:
        table.skip("multi-GPU layouts", "one GPU: bench comm and the NCCL layouts need two")


if __name__ == "__main__":
    sys.exit(main())
