"""Throughput, memory and model-state sharding of every parity-matrix layout, on CPU with gloo.

Side by side in one run: the one-process reference and each layout of
`tests/distributed/test_parity_matrix.py` (plus ZeRO-1/2/3 at dp_shard 4), each in a fresh
torchrun launch of `parallel_layouts_worker.py` (the reference as a plain process, as
`dstrain train` runs it), one after the other. Same run everywhere: the debug flavor, seq_len 128,
global batch 16 in micro-batches of 4, a small corpus of stdlib sources (tokenized once, before
the first launch), W warm-up steps then N timed steps through `trainer._one_step()`.

Columns:
- tok/s: global target tokens of the timed steps / their wall time (barriers around them), and
  that divided by the ranks. One intra-op thread per rank (torchrun's default): the one-process
  run leaves the second core idle, and 4 ranks oversubscribe the 2 cores.
- RSS: `ru_maxrss` of each rank after the steps (largest rank shown). One fresh process per
  layout, so it is that layout's own high-water mark; but it includes Python, torch and dstrain
  (the header gives what a rank holds after its imports), and each rank builds the full model
  before sharding it, so it barely shows the sharding of a 7 MB model; hence:
- state: bytes of parameters + gradients + optimizer states that a rank holds, counted from its
  tensors (local shards of DTensors, FSDP2's all-gathered copies while alive, each storage once;
  see the worker) at two points of one extra micro-step after the timed ones: end of forward
  ("fwd": FSDP2 still holds what it gathered and keeps after forward; no gradients, the last
  step's `zero_grad` freed them) and end of backward, before any `zero_grad` ("bwd": gradients;
  FSDP2 has resharded its parameters). The larger is shown, with its point; largest rank.
- pred: that figure from the one-process P (parameters), G (gradients), O (optimizer states),
  fp32 bytes, split per parameter: a tensor placed Shard on tp (ep) is 1/tp (1/ep) of its
  one-process size; then over the ZeRO shard degree N (dp_shard; for routed experts efsdp, as
  docs/parallelism.md's folding rule says) ZeRO-1 keeps P + P/N + G + O/N (FSDP2's gathered
  fp32 weights beside their fp32 shards, whole gradients accumulated while the sync is deferred: the
  measured micro-step is a first micro-batch of several), ZeRO-2 P + (G + O)/N, ZeRO-3
  (P + G + O)/N. ok: every rank within 10 %.

FSDP2's "ZeRO-2" (reshard_after_forward=False) is not DeepSpeed's: parameters are whole only
from forward to backward, resharded after it. At "fwd" it holds P whole + P/N sharded + O/N and
no gradients, which equals P + (G + O)/N only because G = P (and routed experts, outside FSDP,
have no sharded copy to stand in for their gradients: ep + ZeRO-2 reads lower). ZeRO-3 keeps the
root module (embedding, head, final norm, MTP projection: 30 % of this model) gathered after
forward, so its "fwd" point can exceed (P + G + O)/N. The detail lines add, unchecked, the
largest total seen while gradients land during that backward, where gathered parameters and
whole, not yet reduce-scattered gradients coexist.

Then two checks that TP and EP really split what they claim to: the tensors placed Shard on the
tp (ep) axis must hold 1/2 of their one-process bytes per rank at tp2 (ep2).

Usage: python benchmarks/parallel_layouts.py [--steps N] [--warmup W] [--repeats R]
           [--only NAME,...] [--threads T] [--set k=v ...]
(about 4 minutes with the defaults on a quiet machine; R > 1 repeats the whole sequence and
takes the median tok/s)
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)
from launch_workers import REPO, free_port

from dstrain.config.flavors import model_name, resolve_model_args
from dstrain.config.load import load_config
from dstrain.config.parallel_dims import ParallelDims
from dstrain.data.build import build_dataset

WORKER = Path(__file__).with_name("parallel_layouts_worker.py")
TOLERANCE = 0.10
HALF_TOLERANCE = 0.01
MB = 1e6


@dataclass(frozen=True)
class Layout:
    name: str
    ranks: int
    overrides: tuple[str, ...] = ()


def _dp(shard: int, zero: int, *more: str) -> tuple[str, ...]:
    return (f"parallel.dp_shard={shard}", f"parallel.zero_stage={zero}", *more)


LAYOUTS = [
    Layout("one process", 1),
    Layout("dp2 ddp", 2, _dp(2, 0)),
    Layout("dp2 zero1", 2, _dp(2, 1)),
    Layout("dp2 zero2", 2, _dp(2, 2)),
    Layout("dp2 zero3", 2, _dp(2, 3)),
    Layout(
        "dp2 zero3 offload",
        2,
        _dp(2, 3, "parallel.offload_optimizer=true", "parallel.offload_params=true"),
    ),
    Layout("tp2", 2, ("parallel.tp=2", "parallel.sequence_parallel=false")),
    Layout("tp2 sp", 2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    Layout("dp2 ep2 zero2", 2, _dp(2, 2, "parallel.ep=2")),
    Layout("tp2 ep2", 2, ("parallel.tp=2", "parallel.ep=2")),
    Layout("dp4 zero1", 4, _dp(4, 1)),
    Layout("dp4 zero2", 4, _dp(4, 2)),
    Layout("dp4 zero3", 4, _dp(4, 3)),
    Layout("hsdp 2x2 zero3", 4, ("parallel.dp_replicate=2", *_dp(2, 3))),
    Layout("dp2 tp2 zero2", 4, _dp(2, 2, "parallel.tp=2")),
    Layout("dp4 ep2 zero3", 4, _dp(4, 3, "parallel.ep=2")),
]
HALF_CHECKS = {"tp2": ("tp",), "tp2 sp": ("tp",), "dp2 ep2 zero2": ("ep",), "tp2 ep2": ("tp", "ep")}


def make_corpus(root: Path) -> Path:
    """The parity test's corpus: stdlib json and email sources (a few hundred KB)."""
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py")):
        (corpus / f"{source.parent.name}_{source.stem}.txt").write_text(source.read_text())
    return corpus


def launch(layout: Layout, common: list[str], spec: dict, out_dir: Path, threads: int) -> list:
    """One fresh launch of the worker; returns each rank's result."""
    out_dir.mkdir(parents=True)
    spec = {**spec, "overrides": [*common, f"run.name={out_dir.name}", *layout.overrides]}
    args = [str(WORKER), str(out_dir), json.dumps(spec)]
    if layout.ranks > 1:
        rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(layout.ranks), *rdzv, *args]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": str(threads),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"{layout.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(layout.ranks)]


def dims_of(layout: Layout, common: list[str]) -> tuple[ParallelDims, int]:
    p = load_config(None, [*common, *layout.overrides]).config.parallel
    dims = ParallelDims.of(p, layout.ranks)
    return dims, p.zero_stage


def predict(reference: dict, params: dict, dims: ParallelDims, zero: int) -> float:
    """Model-state bytes per rank: module docstring, "pred"."""
    total = 0.0
    for name, (p, g, o) in reference.items():
        info = params[name]
        split = (dims.tp if info["tp"] else 1) * (dims.ep if info["ep"] else 1)
        p, g, o = p / split, g / split, o / split
        n = dims.efsdp if info["ep"] else dims.dp_shard
        if dims.dp > 1 and zero == 1:
            p, o = p + p / n, o / n
        elif dims.dp > 1 and zero == 2:
            g, o = g / n, o / n
        elif dims.dp > 1 and zero == 3:
            p, g, o = p / n, g / n, o / n
        total += p + g + o
    return total


def state_peak(rank: dict) -> tuple[float, str]:
    """The checked figure: the larger of the two snapshots (not the transient in-backward one)."""
    fwd, bwd = (sum(rank["state"][at].values()) for at in ("fwd", "bwd"))
    return (fwd, "fwd") if fwd > bwd else (bwd, "bwd")


@dataclass
class Row:
    layout: Layout
    ranks: list[dict]
    tok_s: float
    predicted: float

    @property
    def peaks(self) -> list[tuple[float, str]]:
        return [state_peak(r) for r in self.ranks]

    @property
    def ok(self) -> bool:
        return all(abs(s / self.predicted - 1) <= TOLERANCE for s, _ in self.peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the whole sequence")
    parser.add_argument("--only", help="comma-separated layout names (the reference always runs)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--set", action="append", default=[], help="config override, k=v")
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    layouts = LAYOUTS
    if args.only:
        wanted = {n.strip() for n in args.only.split(",")}
        unknown = wanted - {lay.name for lay in LAYOUTS}
        if unknown:
            parser.error(f"unknown layouts {sorted(unknown)}; known: {[x.name for x in LAYOUTS]}")
        layouts = [lay for lay in LAYOUTS if lay.name in wanted or lay.ranks == 1]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        common = [
            f"data.source={make_corpus(root)}",
            f"data.cache_dir={root / 'cache'}",
            f"run.root={root / 'runs'}",
            f"train.steps={args.warmup + args.steps + 1}",  # + 1: the measuring micro-step
            "train.seq_len=128",
            "train.micro_batch_size=4",
            "train.global_batch_size=16",
            "lr.warmup_steps=2",
            "metrics.tensorboard=false",
            "checkpoint.enable=false",
            *args.set,
        ]
        config = load_config(None, common).config
        # Tokenize once here, so no launch trains the tokenizer (or races another rank at it).
        build_dataset(
            config.data,
            vocab_size=resolve_model_args(config.model).vocab_size,
            seq_len=config.train.seq_len,
        )
        spec = {"warmup": args.warmup, "steps": args.steps}
        runs = run_all(layouts, common, spec, root, args)
    report(config, runs, common, args, time.perf_counter() - started)


def run_all(layouts: list[Layout], common: list[str], spec: dict, root: Path, args) -> dict:
    """{layout name: [each repeat's rank results]}; a failed launch is reported and skipped."""
    runs: dict[str, list[list[dict]]] = {}
    for repeat in range(args.repeats):
        for i, layout in enumerate(layouts):
            out_dir = root / "out" / f"r{repeat}_{i}"
            t0 = time.perf_counter()
            try:
                ranks = launch(layout, common, spec, out_dir, args.threads)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"  {layout.name}: {exc}", file=sys.stderr)
                continue
            finally:
                shutil.rmtree(root / "runs", ignore_errors=True)
            runs.setdefault(layout.name, []).append(ranks)
            print(
                f"  [{repeat + 1}/{args.repeats}] {layout.name:<18} {layout.ranks} ranks, "
                f"launch {time.perf_counter() - t0:5.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return runs


def report(config, runs: dict, common: list[str], args, wall: float) -> None:
    reference = runs["one process"][-1][0]["per_name"]
    params, grads, states = (sum(v[i] for v in reference.values()) for i in range(3))
    m = resolve_model_args(config.model)
    print(
        f"model {model_name(config.model)} (dim {m.dim}, {m.num_layers} layers, "
        f"{m.num_routed_experts} routed experts, MTP {m.num_mtp_modules}), seq "
        f"{config.train.seq_len}, global batch {config.train.global_batch_size} in micro-batches "
        f"of {config.train.micro_batch_size}, {config.train.precision}; {args.warmup} warm-up + "
        f"{args.steps} timed steps; {args.threads} thread(s) per rank; {args.repeats} repeat(s)"
    )
    print(
        f"one process holds P {params / MB:.2f} MB parameters, G {grads / MB:.2f} MB gradients, "
        f"O {states / MB:.2f} MB optimizer states (fp32; {params // 4:,} parameters)"
    )
    imports = [r["rss_after_imports_mb"] for rs in runs.values() for r in rs[-1]]
    print(
        f"RSS of a rank after importing torch and dstrain, before the Trainer: "
        f"{min(imports):.0f}-{max(imports):.0f} MB"
    )
    print()
    head = (
        f"{'layout':<18} {'ranks':>5} {'tok/s':>7} {'tok/s/rank':>10} {'RSS MB/rank':>11} "
        f"{'state MB/rank':>13} {'at':>3} {'pred MB':>7}  ok"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for layout in LAYOUTS:
        if layout.name not in runs:
            continue
        results = runs[layout.name]
        last = results[-1]
        tok_s = statistics.median(r[0]["tokens"] / max(x["seconds"] for x in r) for r in results)
        dims, zero = dims_of(layout, common)
        row = Row(layout, last, tok_s, predict(reference, last[0]["params"], dims, zero))
        rows.append(row)
        state, at = max(row.peaks)
        rss = max(r["peak_rss_mb"] for r in last)
        print(
            f"{layout.name:<18} {layout.ranks:>5} {tok_s:>7,.0f} {tok_s / layout.ranks:>10,.0f} "
            f"{rss:>11,.0f} {state / MB:>13.2f} {at:>3} {row.predicted / MB:>7.2f}  "
            f"{'PASS' if row.ok else 'FAIL'}"
        )
    print()
    detail(rows, reference)
    print(f"\nwhole benchmark {wall:.0f} s wall (launch start-up included)")


def detail(rows: list[Row], reference: dict) -> None:
    print(
        "model state per rank, MB, params + grads + optimizer states: end of forward | end of "
        "backward | largest while the backward ran (not checked)"
    )
    for row in rows:
        worst = max((s / row.predicted - 1 for s, _ in row.peaks), key=abs)
        in_bwd = max(sum(r["state"]["in_bwd"].values()) for r in row.ranks)
        bucket = row.ranks[0]["ddp_bucket_bytes"]
        extra = f"; DDP's buckets hold {bucket / MB:.2f} MB more" if bucket else ""
        print(
            f"  {row.layout.name:<18} checked {worst:+.1%} off; in backward up to "
            f"{in_bwd / MB:.2f} MB ({in_bwd / row.predicted - 1:+.0%} over pred){extra}"
        )
        for rank, r in enumerate(row.ranks):
            text = " | ".join(_parts(r["state"][at]) for at in ("fwd", "bwd", "in_bwd"))
            print(f"      rank {rank}: {text}")
    print(
        "\nTP/EP split (tensors placed Shard on the axis: their bytes per rank / one process's; "
        "0.5 = split)"
    )
    for row in rows:
        for axis in HALF_CHECKS.get(row.layout.name, ()):
            print(f"  {row.layout.name:<18} {half_check(row, reference, axis)}")


def _parts(state: dict) -> str:
    return "+".join(f"{state[k] / MB:.2f}" for k in ("params", "grads", "optim"))


def half_check(row: Row, reference: dict, axis: str) -> str:
    """Parameters and gradients of the tensors placed Shard on `axis`, per rank, as a share of
    their one-process bytes."""
    params, grads, whole = [], [], set()
    for r in row.ranks:
        names = [n for n, info in r["params"].items() if info[axis]]
        assert all(r["params"][n]["global"] == reference[n][0] for n in names), names
        ref_p, ref_g = (sum(reference[n][i] for n in names) for i in (0, 1))
        params.append(sum(r["params"][n]["local"] for n in names) / ref_p)
        grads.append(sum(r["params"][n]["grad_local"] for n in names) / ref_g)
        whole |= {
            f"{n} {r['params'][n]['grad_placements']}"
            for n in names
            if r["params"][n]["grad_local"] > r["params"][n]["local"]
        }
    share = sum(reference[n][0] for n in names) / sum(v[0] for v in reference.values())
    ok = names and all(abs(x - 0.5) <= HALF_TOLERANCE for x in params + grads)
    note = f"; grads not split: {', '.join(sorted(whole))}" if whole else ""
    return (
        f"{axis}: {len(names)} tensors ({share:.0%} of the parameter bytes), per rank params "
        f"{', '.join(f'{x:.3f}' for x in params)}, grads {', '.join(f'{x:.3f}' for x in grads)} "
        f"{'PASS' if ok else 'FAIL'}{note}"
    )


if __name__ == "__main__":
    main()
