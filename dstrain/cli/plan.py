"""`dstrain plan`: predict memory, step time and MFU of a parallel layout on a cluster, or search
every legal layout for the fastest that fits. Pure Python: no GPU, no process group."""

import argparse
import time
from pathlib import Path

from dstrain.cli.common import add_json_flag, console, positive_int
from dstrain.errors import UserError
from dstrain.planner.engines import ENGINES

_EPILOG = """\
A layout is given when --tp, --pp and --ep all are (--ep may be left out for a dense model; dp
is what the GPUs leave, or --dp): plan then evaluates it, with the other knobs at their
defaults (ZeRO-1, micro-batch 1, 1f1b, no recompute, bf16, sequence parallelism with tp > 1).
Otherwise it searches every layout that
tiles the cluster, keeping the flags you gave fixed, and ranks those that fit and that the
trainer's own rules (dstrain check) accept by step time; then it says why the winner wins and
why the obvious alternatives (one knob changed) lose.

--model is a flavor (debug, deepseek-v3, ...) or a Hugging Face config.json (model_type
deepseek_v3, deepseek_v2, llama, mistral, mixtral, gpt2). --gpu is a name from the hardware
table (A100-40GB, A100-80GB, H100, H800, H200, RTX4090, MI250X, ...; case-insensitive).
Defaults: 8 GPUs per node, InfiniBand NDR (50 GB/s per GPU), sequences of 4096 (or the model's
max_seq_len), a global batch of 8 sequences per GPU. docs/planner.md gives every formula with
its source.

--emit-config writes the evaluated layout (or the winner) as a config that dstrain check, train
and deploy accept. --json prints fits, memory_verdict, memory_margin_gib, memory_gib_per_gpu
(with its floor), legal, illegal_reasons, step_time_s, tokens_per_s, tokens_per_s_per_gpu (and
its 80 % range), tflops_per_gpu, mfu, bubble_fraction, comm_exposed_fraction and layout (the
winner's, in search mode, plus "ranked" and "alternatives").
Memory is "fits", "tight" (the estimate is within 10 % of the device, or over it while its
floor, with a fused loss and balanced routing, is not: the margin is printed) or "does not fit"
(even the floor exceeds the device). An evaluated layout that dstrain's own trainer would refuse
(a limit of its own, such as context parallelism, plain DDP under TP or ZeRO-3 with PP, that
another engine runs) is still estimated; the refusal is printed, and "legal" is false.
exit status: 0 a layout that fits or is tight, 1 one that does not fit or does not tile the
GPUs and the batch (the reasons are printed).

--calibrate RUN_DIR... fits the matmul, attention and memory-streaming efficiencies, the
per-layer overhead and the link efficiency and latency to measured runs (their metrics.jsonl,
summary.json and config.toml) and prints, per run, model states and step time measured against
predicted, before and after.

--validate predicts every published run in dstrain/planner/published (training reports, papers,
official scaling tables; each with its source) and prints predicted against published
tokens/s per GPU, peak memory and bubble, the median errors, the share within 25 %, the runs
it would have called impossible, and each source predicted with the one constant learnt from
the table fitted on the other sources; --published DIR scores your own table instead.

--engine predicts the layout as another engine runs it (megatron: Megatron-LM, NeMo; torchtitan;
composer: llm-foundry), whose loss, selective recompute and FP8 memory differ from dstrain's
trainer (docs/planner.md, "Other engines"); what is legal stays dstrain's verdict.

examples:
  dstrain plan --model deepseek-v3 --gpu H800 --num-gpus 2048
  dstrain plan --model deepseek-v3 --gpu H800 --num-gpus 2048 --pp 16 --ep 64 --tp 1 \\
      --zero 1 --schedule dualpipev --recompute selective --global-batch 15360
  dstrain plan --model config.json --gpu a100-80gb --num-gpus 64 --tp 8 --top 5 --json
  dstrain plan --model deepseek-v2-lite --gpu H100 --num-gpus 16 --emit-config plan.toml
  dstrain plan --calibrate runs/dp2 runs/tp2 runs/ep2
  dstrain plan --model config.json --gpu H100 --num-gpus 64 --tp 4 --pp 2 --engine megatron
  dstrain plan --validate --json
"""

LAYOUT_FLAGS = ("tp", "pp", "ep")
FIXABLE = (
    "dp",
    "tp",
    "pp",
    "ep",
    "zero",
    "micro_batch",
    "schedule",
    "virtual_stages",
    "recompute",
    "sequence_parallel",
)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plan",
        help="predict memory, step time and MFU of a layout; search for the best",
        description="Predict per-GPU memory, step time, tokens/s and MFU of a parallel layout "
        "of a model on a cluster, before launch; or search every legal layout for the fastest "
        "that fits.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_argument_group("model and cluster")
    what.add_argument("--model", help="flavor name or HF config.json path (required)")
    what.add_argument("--gpu", help="GPU type from the hardware table (required)")
    what.add_argument("--num-gpus", type=positive_int, metavar="N", help="(required)")
    what.add_argument("--gpus-per-node", type=positive_int, default=8, metavar="G")
    what.add_argument(
        "--inter-node-gbps",
        type=float,
        metavar="X",
        help="network bandwidth per GPU, GB/s one direction (default: --network's preset)",
    )
    what.add_argument(
        "--network", default="ib-ndr", help="ib-hdr, ib-ndr, roce-200, roce-400, eth-100"
    )
    layout = parser.add_argument_group("layout (any given is kept fixed)")
    for flag in ("dp", "tp", "pp", "ep", "cp"):
        layout.add_argument(f"--{flag}", type=positive_int, metavar="N")
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    layout.add_argument("--micro-batch", type=positive_int, metavar="B")
    layout.add_argument("--global-batch", type=positive_int, metavar="SEQS")
    layout.add_argument(
        "--seq-len",
        type=positive_int,
        metavar="T",
        help="tokens per sequence (default 4096, or the model's max_seq_len if shorter)",
    )
    layout.add_argument(
        "--schedule", choices=("gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev")
    )
    layout.add_argument("--virtual-stages", type=positive_int, metavar="V")
    layout.add_argument("--recompute", choices=("none", "selective", "full"))
    layout.add_argument("--precision", choices=("bf16", "fp16", "fp8"), default="bf16")
    layout.add_argument("--sequence-parallel", action="store_true", default=None)
    layout.add_argument("--offload", action="store_true", help="optimizer states on the host")
    layout.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default="dstrain",
        help="predict the layout as this engine runs it (its loss, selective recompute and FP8 "
        "memory: docs/planner.md); default: dstrain's own trainer",
    )
    layout.add_argument(
        "--adam-moments",
        choices=("fp32", "bf16"),
        default=None,
        help="dtype of Adam's two moments, as the trainer's optim.moments (default: bf16 under "
        "--precision fp8, as DeepSeek-V3, else fp32)",
    )
    parser.add_argument(
        "--calibrate",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="fit the efficiency and bandwidth constants to these measured runs and print "
        "measured vs predicted (instead of planning)",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="score the planner against the published training runs it ships with "
        "(dstrain/planner/published): predicted vs published throughput, memory and bubble",
    )
    parser.add_argument(
        "--published",
        type=Path,
        metavar="DIR",
        help="with --validate: score against the runs in DIR's *.yaml files instead (the format "
        "of dstrain/planner/published/README.md), e.g. a table of your own runs",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=positive_int, default=10, metavar="K")
    out.add_argument("--emit-config", type=Path, metavar="OUT.toml")
    add_json_flag(out)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dstrain.cli.plan_report import calibrate_command, evaluate_command, search_command

    if args.calibrate:
        return calibrate_command(args.calibrate, args, console())
    if args.validate:
        from dstrain.cli.plan_validate import validate_command

        return validate_command(args, console())
    missing = [
        f"--{n.replace('_', '-')}" for n in ("model", "gpu", "num_gpus") if not getattr(args, n)
    ]
    if missing:
        raise UserError(
            f"plan needs {', '.join(missing)}",
            "e.g. dstrain plan --model deepseek-v3 --gpu H800 --num-gpus 2048",
            exit_code=2,
        )
    model, cluster = _model(args.model), _cluster(args)
    args.seq_len = args.seq_len or min(4096, model.max_seq_len)
    base, fixed = _layout(args, cluster.num_gpus)
    started = time.perf_counter()
    needed = LAYOUT_FLAGS if model.num_routed_experts else ("tp", "pp")
    if all(flag in fixed for flag in needed):
        return evaluate_command(model, cluster, base, args, console())
    return search_command(model, cluster, base, fixed, args, console(), started)


def _model(name: str):
    from dstrain.cli.plan_report import hf_config_path
    from dstrain.config.flavors import flavor_args
    from dstrain.config.hf_config import read_hf_config

    path = hf_config_path(name)
    return read_hf_config(path) if path is not None else flavor_args(name)


def _cluster(args: argparse.Namespace):
    from dstrain.hardware import gpu_spec, network_gbps
    from dstrain.planner.layout import Cluster

    gbps = args.inter_node_gbps if args.inter_node_gbps else network_gbps(args.network)
    if gbps <= 0:
        raise UserError(
            f"--inter-node-gbps {gbps:g} must be positive", "give GB/s per GPU, e.g. 50 for NDR"
        )
    return Cluster(gpu_spec(args.gpu), args.num_gpus, args.gpus_per_node, gbps)


def _layout(args: argparse.Namespace, num_gpus: int):
    """The base layout (given values, else defaults) and the names of the given ones."""
    from dstrain.planner.layout import Layout

    given = {name: getattr(args, name) for name in FIXABLE if getattr(args, name) is not None}
    degrees = {k: given.get(k, 1) for k in ("tp", "pp", "ep")} | {"cp": args.cp or 1}
    others = degrees["tp"] * degrees["pp"] * degrees["cp"]
    dp = given.get("dp", num_gpus // others if num_gpus % others == 0 else 0)
    base = Layout(
        dp=max(dp, 1),
        **degrees,
        zero=given.get("zero", 1),
        micro_batch=given.get("micro_batch", 1),
        global_batch=args.global_batch or 8 * num_gpus,
        seq_len=args.seq_len,
        schedule=given.get("schedule", "1f1b"),
        virtual_stages=given.get("virtual_stages", 1),
        recompute=given.get("recompute", "none"),
        precision=args.precision,
        sequence_parallel=given.get("sequence_parallel", degrees["tp"] > 1),
        offload=args.offload,
        adam_moments=args.adam_moments or ("bf16" if args.precision == "fp8" else "fp32"),
        engine=args.engine,
    )
    fixed = set(given) | ({"cp"} if args.cp else set())
    return base, fixed | {"cp", "offload", "precision"}
