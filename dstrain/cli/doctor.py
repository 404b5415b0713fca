"""`dstrain doctor`: is this machine, or a cluster whose `nvidia-smi topo -m` / `ibstat` output
was saved, set up right for training? Each check is ok / warn / fail, with the fix."""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from dstrain.cli.common import (
    add_json_flag,
    add_set_arg,
    console,
    non_negative_int,
    positive_int,
    print_json,
)

if TYPE_CHECKING:
    from dstrain.doctor.run import Report
    from dstrain.doctor.topology import Topology

_EPILOG = """\
Local mode (the default) checks this machine: Python/torch/CUDA/NCCL versions, the GPUs (NVML
when nvidia-ml-py is installed, else torch), `nvidia-smi topo -m`, InfiniBand/RoCE ports in
/sys/class/infiniband, the NCCL_* environment, /dev/shm, the open-files limit, free disk and a
short sequential-read test of --data-dir. Without GPUs it says so and checks the rest.

--topology-from FILE / --ib-from FILE diagnose a saved `nvidia-smi topo -m` / `ibstat` output
from a machine you cannot log into; only the files are checked, unless --all adds this machine.
With a layout (--config, --set parallel.tp=N, or --tp/--ep) doctor warns when a TP group of
consecutive GPUs (tp, or ep, as the trainer's mesh lays them out) spans a pair without NVLink.

--json prints {"checks": [...], "topology": {"devices", "matrix": {"GPU0": {"GPU1": "NV12"}},
"affinity", "nic_legend"}, "infiniband": [...], "summary": {...}}. docs/doctor.md lists every
check, its threshold and the threshold's source.
exit status: 0 no failed check (warnings allowed), 1 a check failed, 2 unreadable input.

examples:
  dstrain doctor
  dstrain doctor --config run.toml --data-dir /data/tokens
  dstrain doctor --topology-from topo.txt --tp 8
  dstrain doctor --topology-from topo.txt --ib-from ibstat.txt --json
  dstrain doctor --read-test-mib 0 --all --topology-from topo.txt
"""
MARKS = {"ok": ("ok", "green"), "warn": ("WARN", "yellow"), "fail": ("FAIL", "bold red")}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check this machine (or a saved topology/ibstat) before a launch",
        description="Check GPUs, topology, InfiniBand, NCCL environment and host limits; "
        "every check is ok / warn / fail with the fix.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    layout = parser.add_argument_group("layout (for the TP/EP topology checks)")
    layout.add_argument("--config", type=Path, metavar="CONFIG", help="a dstrain/DeepSpeed config")
    add_set_arg(layout, "override a config key, e.g. --set parallel.tp=4 (repeatable)")
    layout.add_argument(
        "--tp", type=positive_int, metavar="N", help="beats the config's parallel.tp"
    )
    layout.add_argument(
        "--ep", type=positive_int, metavar="N", help="beats the config's parallel.ep"
    )
    saved = parser.add_argument_group("saved outputs from another machine")
    saved.add_argument("--topology-from", type=Path, metavar="FILE", help="`nvidia-smi topo -m`")
    saved.add_argument("--ib-from", type=Path, metavar="FILE", help="`ibstat` output")
    saved.add_argument("--all", action="store_true", help="also run this machine's checks")
    host = parser.add_argument_group("this machine")
    host.add_argument(
        "--data-dir", type=Path, default=Path("."), metavar="DIR", help="run/data directory (.)"
    )
    host.add_argument(
        "--read-test-mib",
        type=non_negative_int,
        default=256,
        metavar="MIB",
        help="size of the read-speed test file (default 256; 0 skips the test)",
    )
    host.add_argument(
        "--num-workers",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="DataLoader workers per rank, sizes the /dev/shm check",
    )
    add_json_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dstrain.doctor.run import Options, run_doctor

    tp, ep = _layout(args)
    opts = Options(
        topology_from=args.topology_from,
        ib_from=args.ib_from,
        all=args.all,
        tp=tp,
        ep=ep,
        data_dir=args.data_dir,
        read_test_mib=args.read_test_mib,
        num_workers=args.num_workers,
    )
    err = console(stderr=True)
    if args.json or not err.is_terminal:
        report = run_doctor(opts)
    else:
        with err.status("dstrain doctor: checking ..."):
            report = run_doctor(opts)
    if args.json:
        print_json(report.to_json())
    else:
        render(report, console())
    return report.exit_code


def _layout(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(tp, ep): flags beat the config; None when neither a config nor a flag says."""
    tp = ep = None
    if args.config is not None or args.overrides:
        from dstrain.config.load import load_config

        parallel = load_config(args.config, args.overrides).config.parallel
        tp, ep = parallel.tp, parallel.ep
    return args.tp or tp, args.ep or ep


def render(report: "Report", out: Console) -> None:
    """Checks grouped by section, the fix under each non-ok one, then the parsed matrix."""
    from dstrain.doctor.findings import SECTIONS, summarize

    counts = summarize(report.checks)
    out.print(
        f"dstrain doctor ({report.mode}): {counts['ok']} ok, {counts['warn']} warn, "
        f"{counts['fail']} fail",
        markup=False,
    )
    for section in SECTIONS:
        checks = [c for c in report.checks if c.section == section]
        if not checks:
            continue
        out.print(Text(f"\n{section}", style="bold"))
        for check in checks:
            mark, style = MARKS[check.status]
            line = Text("  ")
            line.append(f"{mark:<4}", style=style)
            line.append(f"  {check.name}: {check.detail}")
            out.print(line)
            if check.fix:
                out.print(Text(f"        fix: {check.fix}", style="dim"))
    if report.topology is not None:
        out.print(Text("\ntopology (as parsed)", style="bold"))
        for line in _matrix_lines(report.topology):
            out.print(line, markup=False, overflow="ignore", crop=False)


def _matrix_lines(topology: "Topology") -> list[str]:
    """The parsed matrix, re-printed the way nvidia-smi aligns it (never wrapped)."""
    keys = [k for k in ("cpu", "numa") if any(k in a for a in topology.affinity.values())]
    header = ["", *topology.devices, *(f"{k.upper()} Affinity" for k in keys)]
    rows = [header]
    for row in topology.devices:
        cells = [
            topology.link(row, col) or ("X" if row == col else "?") for col in topology.devices
        ]
        rows.append([row, *cells, *(topology.affinity.get(row, {}).get(k, "") for k in keys)])
    widths = [max(len(line[i]) for line in rows if i < len(line)) + 2 for i in range(len(header))]
    lines = [
        "".join(c.ljust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in rows
    ]
    if topology.nic_legend:
        lines.append("NIC legend: " + ", ".join(f"{k}={v}" for k, v in topology.nic_legend.items()))
    return lines
