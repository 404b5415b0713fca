"""What a parsed topology means for a training layout: NVLink per pair, GPU -> NUMA node, TP/EP
groups that span PCIe-only pairs, and NICs far from their GPUs.

Rank order within a node follows the trainer's mesh (parallel/mesh.py): tp is the innermost
axis, so GPUs 0..tp-1 form the first TP group; the expert view folds ep innermost too, so an EP
group is ep consecutive GPUs (0..ep-1 first), holding whole TP groups when ep >= tp."""

from collections import Counter
from itertools import combinations

from dstrain.doctor.findings import Check, ok, warn
from dstrain.doctor.topology import Topology, nvlink_count, pcie_rank

SECTION = "topology"
NEAR = 2  # PIX or PXB: the NIC shares a PCIe switch with the GPU (GPUDirect RDMA at full speed)
FAR = 4  # NODE or SYS: traffic crosses the CPU's host bridges, or the socket interconnect
MAX_LISTED = 6
UNKNOWN = 9  # the PCIe rank of a pair a cut-short paste shows no link for


def topology_checks(topo: Topology, tp: int | None = None, ep: int | None = None) -> list[Check]:
    """All topology findings; the TP/EP checks run only when a layout is given."""
    checks = [_damage(topo)] if topo.notes else []
    checks += [nvlink_summary(topo), numa_map(topo)]
    if tp is not None:
        checks += tp_checks(topo, tp, ep or 1)
    return checks + nic_checks(topo)


def _damage(topo: Topology) -> Check:
    return warn(
        SECTION,
        "paste",
        "; ".join(topo.notes),
        "paste the whole `nvidia-smi topo -m` output inside a code block",
    )


def nvlink_summary(topo: Topology) -> Check:
    """The link of every GPU pair, counted: `NV12 x28` or `NV1 x8, NV2 x8, SYS x12`."""
    pairs = list(combinations(topo.gpus, 2))
    if not pairs:
        return ok(SECTION, "nvlink", f"{len(topo.gpus)} GPU: no GPU pairs")
    counts = Counter(topo.link(a, b) or "?" for a, b in pairs)
    links = ", ".join(f"{link} x{n}" for link, n in sorted(counts.items(), key=_link_order))
    linked = sum(n for link, n in counts.items() if nvlink_count(link))
    detail = f"{len(topo.gpus)} GPUs, {len(pairs)} pairs: {links} ({linked} with NVLink)"
    return ok(SECTION, "nvlink", detail)


def _link_order(item: tuple[str, int]) -> tuple[int, int]:
    return (-nvlink_count(item[0]), pcie_rank(item[0]))


def numa_map(topo: Topology) -> Check:
    """GPUs grouped by NUMA node (new format) or by CPU affinity (old format)."""
    key = "numa" if any("numa" in a for a in topo.affinity.values()) else "cpu"
    groups: dict[str, list[str]] = {}
    for gpu in topo.gpus:
        groups.setdefault(topo.affinity.get(gpu, {}).get(key, "?"), []).append(gpu)
    label = "NUMA" if key == "numa" else "CPUs"
    detail = "; ".join(f"{label} {node}: {', '.join(gpus)}" for node, gpus in groups.items())
    return ok(SECTION, "numa", detail or "no affinity columns")


def tp_checks(topo: Topology, tp: int, ep: int) -> list[Check]:
    """TP groups (and node-local EP groups) over pairs without NVLink."""
    gpus = topo.gpus
    checks = []
    if tp > len(gpus):
        checks.append(
            warn(
                SECTION,
                "tp across nodes",
                f"tp={tp} > {len(gpus)} GPUs per node: tensor-parallel all-reduces cross the "
                "network in every layer",
                f"keep tp <= {len(gpus)} (one node) and scale with dp/pp/ep",
            )
        )
    tp_groups = _consecutive(gpus, min(tp, len(gpus)))
    checks.append(_group_check(topo, f"tp={tp}", "TP", tp_groups))
    if ep > len(gpus):
        checks.append(ok(SECTION, f"ep={ep}", f"ep={ep} spans nodes: EP all-to-all uses the NICs"))
    elif ep > 1:
        checks.append(_group_check(topo, f"ep={ep}", "EP", _consecutive(gpus, ep)))
    return checks


def _consecutive(gpus: list[str], size: int) -> list[list[str]]:
    return [gpus[i : i + size] for i in range(0, len(gpus) - size + 1, size)]


def _group_check(topo: Topology, name: str, axis: str, groups: list[list[str]]) -> Check:
    pairs = [(a, b, topo.link(a, b)) for group in groups for a, b in combinations(group, 2)]
    bad = [(a, b, link) for a, b, link in pairs if link is not None and not nvlink_count(link)]
    # A cut-short paste has no cell for some pairs: nothing to judge them by, so not "bad".
    unknown = [f"{a}-{b}" for a, b, link in pairs if link is None]
    if not bad and unknown:
        listed = ", ".join(unknown[:MAX_LISTED]) + (" ..." if len(unknown) > MAX_LISTED else "")
        return warn(
            SECTION,
            name,
            f"the paste shows no link for {listed}: cannot tell whether every {axis} group is "
            "NVLinked (the pairs it does show are)",
            "paste the whole `nvidia-smi topo -m` output",
        )
    if not bad:
        shown = ", ".join(f"{g[0]}-{g[-1]}" for g in groups[:4])
        return ok(SECTION, name, f"every {axis} group ({shown}) is fully NVLinked")
    listed = ", ".join(f"{a}-{b} ({link})" for a, b, link in bad[:MAX_LISTED])
    more = f" and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
    largest = largest_nvlinked_group(topo)
    fix = (
        f"use tp <= {largest} (the largest TP whose groups are all NVLinked here) or a node "
        "type with NVSwitch (every pair NV#)"
        if axis == "TP"
        else f"use ep <= {largest} (the largest group of consecutive GPUs all NVLinked here), "
        "or an ep larger than the node so its all-to-all runs over the NICs"
    )
    return warn(
        SECTION,
        name,
        f"{axis} groups span GPU pairs without NVLink: {listed}{more}; their collectives run at "
        "PCIe/CPU-interconnect speed",
        fix,
    )


def largest_nvlinked_group(topo: Topology) -> int:
    """The largest group size dividing the GPU count whose consecutive groups are all
    NVLinked: the largest tp (or node-local ep) that stays on NVLink."""
    gpus = topo.gpus
    for size in range(len(gpus), 1, -1):
        if len(gpus) % size:
            continue
        groups = [gpus[i : i + size] for i in range(0, len(gpus), size)]
        links = [topo.link(a, b) for g in groups for a, b in combinations(g, 2)]
        if all(link is None or nvlink_count(link) for link in links):  # None: not in the paste
            return size
    return 1


def nic_checks(topo: Topology) -> list[Check]:
    """NICs whose nearest GPU is NODE/SYS away, and GPUs with no NIC at PIX/PXB."""
    if not topo.nics or not topo.gpus:
        return []
    checks = []
    # Each device's nearest counterpart, found once: (name, PCIe rank).
    gpu_of = {nic: _nearest(topo, nic, topo.gpus) for nic in topo.nics}
    nic_of = {gpu: _nearest(topo, gpu, topo.nics) for gpu in topo.gpus}
    # Rank UNKNOWN: a cut-short paste shows no link for that device; nothing to judge it by.
    far = [nic for nic in topo.nics if FAR <= gpu_of[nic][1] < UNKNOWN]
    if far:
        listed = ", ".join(
            f"{topo.nic_name(n)} (nearest {gpu_of[n][0]} at {topo.link(n, gpu_of[n][0])})"
            for n in far
        )
        names = ",".join(topo.nic_legend.get(n, n) for n in far)  # `^=` covers the list
        checks.append(
            warn(
                SECTION,
                "far NICs",
                f"far from every GPU: {listed}",
                f"if NCCL may pick it, GPUDirect RDMA crosses the CPU: exclude it with "
                f"NCCL_IB_HCA=^={names} (fine for storage/management NICs), or move the card "
                "under a GPU's PCIe switch",
            )
        )
    lonely = [g for g in topo.gpus if NEAR < nic_of[g][1] < UNKNOWN]
    if lonely:
        detail = ", ".join(
            f"{g} (nearest {topo.nic_name(nic_of[g][0])} at {topo.link(g, nic_of[g][0])})"
            for g in lonely[:MAX_LISTED]
        )
        more = f" and {len(lonely) - MAX_LISTED} more" if len(lonely) > MAX_LISTED else ""
        checks.append(
            warn(
                SECTION,
                "GPU-NIC",
                f"no NIC at PIX/PXB for {detail}{more}: their inter-node traffic crosses the "
                "host bridge",
                "one NIC per GPU (or GPU pair) under the same PCIe switch is the DGX/HGX layout; "
                "on this node expect lower multi-node bandwidth, or use a node type that has it",
            )
        )
    if not checks:
        placed = [g for g in topo.gpus if nic_of[g][1] < UNKNOWN]
        pairs = ", ".join(f"{g}->{topo.nic_name(nic_of[g][0])}" for g in placed[:4])
        which = "every GPU" if len(placed) == len(topo.gpus) else "every GPU the paste places"
        checks.append(ok(SECTION, "GPU-NIC", f"{which} has a NIC at PIX/PXB ({pairs}, ...)"))
    return checks


def _nearest(topo: Topology, device: str, others: list[str]) -> tuple[str, int]:
    """The nearest of `others` by PCIe distance; rank UNKNOWN when a link the paste does not
    show could be nearer than every link it shows."""
    ranked = [(pcie_rank(topo.link(device, o)) or UNKNOWN, o) for o in others]
    rank, name = min(ranked)
    if rank > NEAR and any(r == UNKNOWN for r, _ in ranked):
        return name, UNKNOWN
    return name, rank
