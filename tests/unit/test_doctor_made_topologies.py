"""Topologies written down here by hand and rendered into `nvidia-smi topo -m` text.

They cover what no complete paste from a public issue thread was found for (the committed samples
in tests/fixtures/doctor/topo/ are issue-thread pastes only, several of them cut short):

- a DGX-1 (8 x V100 SXM2): the NVLink hybrid cube mesh, in the old format (NIC column named by
  device, CPU Affinity only), with one HCA under GPU2/GPU3's PCIe switch;
- the same mesh with four HCAs (mlx5_0..mlx5_3 columns) behind a `$ nvidia-smi topo -m` prompt;
- a DGX A100: NV12 everywhere, ten NICs (two per GPU pair, plus a storage pair that is SYS to
  every GPU), tab-separated, NIC Legend, inside a markdown fence.

Other doctor test modules import the renderings; the tests here check that the tables are the
layouts they claim to be and that every rendering parses back to its table.
"""

from dataclasses import dataclass, field
from itertools import combinations

import pytest

from dstrain.doctor.topology import nvlink_count, parse_topology

# The header labels nvidia-smi prints after the device columns -> the parser's affinity keys.
KEYS = {"CPU Affinity": "cpu", "NUMA Affinity": "numa", "GPU NUMA ID": "gpu_numa_id"}
LEGEND = [
    "Legend:",
    "",
    "  X    = Self",
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes "
    "(e.g., QPI/UPI)",
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges "
    "within a NUMA node",
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
    "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host "
    "Bridge)",
    "  PIX  = Connection traversing at most a single PCIe bridge",
    "  NV#  = Connection traversing a bonded set of # NVLinks",
]


@dataclass(frozen=True)
class MadeTopology:
    """The cell of every device pair, and the affinity columns of each GPU."""

    devices: list[str]
    cells: dict[frozenset[str], str]
    labels: list[str]
    affinity: dict[str, list[str]]
    nic_legend: dict[str, str] = field(default_factory=dict)

    def link(self, a: str, b: str) -> str:
        return self.cells[frozenset((a, b))]

    def matrix(self) -> dict[tuple[str, str], str]:
        return {(a, b): self.link(a, b) for a in self.devices for b in self.devices if a != b}

    def expected_affinity(self) -> dict[str, dict[str, str]]:
        return {
            gpu: {KEYS[label]: value for label, value in zip(self.labels, values, strict=True)}
            for gpu, values in self.affinity.items()
        }

    def render(
        self, *, tabs: bool = True, prompt: str | None = None, fence: bool = False, prefix: str = ""
    ) -> str:
        """nvidia-smi's layout: tab-separated (new drivers) or padded to 8 columns (old ones)."""
        rows = [["", *self.devices, *self.labels]]
        for name in self.devices:
            cells = [" X " if other == name else self.link(name, other) for other in self.devices]
            rows.append([name, *cells, *self.affinity.get(name, [""] * len(self.labels))])
        if tabs:
            lines = ["\t".join(row) for row in rows]
        else:
            width = len(self.devices) + 1
            lines = [
                ("".join(c.ljust(8) for c in row[:width]) + "    ".join(row[width:])).rstrip()
                for row in rows
            ]
        lines += ["", *LEGEND]
        if self.nic_legend:
            lines += ["", "NIC Legend:", ""]
            lines += [f"  {nic}: {name}" for nic, name in self.nic_legend.items()]
        lines = ([prompt] if prompt else []) + lines + [""]
        if fence:
            lines = ["```", *lines, "```"]
        return "\n".join(prefix + line if line else prefix.rstrip() for line in lines) + "\n"


GPUS = [f"GPU{i}" for i in range(8)]
# DGX-1 (V100): each GPU's six NVLinks, bonded in ones and twos. GPUs 0-3 and 4-7 form two fully
# linked quads, and GPU i is linked to GPU i+4; the 12 other pairs have no NVLink (SYS).
DGX1_NVLINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2,
    (1, 2): 2, (1, 3): 1, (1, 5): 2,
    (2, 3): 2, (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1, (4, 6): 1, (4, 7): 2,
    (5, 6): 2, (5, 7): 1,
    (6, 7): 2,
}  # fmt: skip
DGX1_CPUS = ["0-19,40-59"] * 4 + ["20-39,60-79"] * 4  # two 20-core Xeons, hyperthreaded


def _dgx1_gpu_cells() -> dict[frozenset[str], str]:
    cells = {}
    for a, b in combinations(range(8), 2):
        bonded = DGX1_NVLINKS.get((a, b))
        cells[frozenset((GPUS[a], GPUS[b]))] = f"NV{bonded}" if bonded else "SYS"
    return cells


def _dgx1_one_hca() -> MadeTopology:
    """The mesh with a single HCA: PIX to GPU2/GPU3, NODE to GPU0/GPU1, SYS to the other socket."""
    cells = _dgx1_gpu_cells()
    for i, gpu in enumerate(GPUS):
        cells[frozenset((gpu, "mlx5_0"))] = "NODE" if i < 2 else "PIX" if i < 4 else "SYS"
    affinity = {gpu: [cpus] for gpu, cpus in zip(GPUS, DGX1_CPUS, strict=True)}
    return MadeTopology([*GPUS, "mlx5_0"], cells, ["CPU Affinity"], affinity)


def _dgx1_four_hcas() -> MadeTopology:
    """The mesh with one HCA per GPU pair (mlx5_k under GPU 2k and 2k+1's switch)."""
    nics = [f"mlx5_{k}" for k in range(4)]
    cells = _dgx1_gpu_cells()
    for i, gpu in enumerate(GPUS):
        for k, nic in enumerate(nics):
            same_socket = i // 4 == k // 2
            cells[frozenset((gpu, nic))] = "PIX" if i // 2 == k else "PHB" if same_socket else "SYS"
    for (j, a), (k, b) in combinations(enumerate(nics), 2):
        cells[frozenset((a, b))] = "PHB" if j // 2 == k // 2 else "SYS"
    affinity = {gpu: [cpus] for gpu, cpus in zip(GPUS, DGX1_CPUS, strict=True)}
    return MadeTopology([*GPUS, *nics], cells, ["CPU Affinity"], affinity)


# DGX A100: GPU pairs (0,1) (2,3) (4,5) (6,7) sit on NUMA nodes 3, 1, 7, 5 of two EPYC 7742s.
A100_NUMA = ["3", "3", "1", "1", "7", "7", "5", "5"]
A100_CPUS = {
    "3": "48-63,176-191",
    "1": "16-31,144-159",
    "7": "112-127,240-255",
    "5": "80-95,208-223",
}


def _dgx_a100() -> MadeTopology:
    """NV12 between all GPUs; NIC 2k, 2k+1 under GPU 2k, 2k+1's switches (PXB); the storage pair
    NIC8/NIC9 shares one switch (PIX) and is SYS to every GPU."""
    nics = [f"NIC{k}" for k in range(10)]
    cells = {frozenset(pair): "NV12" for pair in combinations(GPUS, 2)}
    for i, gpu in enumerate(GPUS):
        for k, nic in enumerate(nics):
            cells[frozenset((gpu, nic))] = "PXB" if k < 8 and k // 2 == i // 2 else "SYS"
    for (j, a), (k, b) in combinations(enumerate(nics), 2):
        cell = "PIX" if j >= 8 and k >= 8 else "PXB" if k < 8 and j // 2 == k // 2 else "SYS"
        cells[frozenset((a, b))] = cell
    affinity = {gpu: [A100_CPUS[node], node] for gpu, node in zip(GPUS, A100_NUMA, strict=True)}
    legend = {nic: f"mlx5_{k}" for k, nic in enumerate(nics)}
    return MadeTopology([*GPUS, *nics], cells, ["CPU Affinity", "NUMA Affinity"], affinity, legend)


DGX1 = _dgx1_one_hca()
DGX1_FOUR_HCAS = _dgx1_four_hcas()
DGX_A100 = _dgx_a100()
# The renderings the other modules use.
DGX1_TEXT = DGX1.render(tabs=False)
DGX1_FOUR_HCAS_PROMPT_TEXT = DGX1_FOUR_HCAS.render(tabs=False, prompt="$ nvidia-smi topo -m")
DGX_A100_TEXT = DGX_A100.render(tabs=True, fence=True)
RENDERINGS = {
    "dgx1_old_format": (DGX1, DGX1_TEXT),
    "dgx1_four_hcas_prompt": (DGX1_FOUR_HCAS, DGX1_FOUR_HCAS_PROMPT_TEXT),
    "dgx_a100_tabs_fenced": (DGX_A100, DGX_A100_TEXT),
    "dgx1_tabs": (DGX1, DGX1.render(tabs=True)),
    "dgx_a100_spaces": (DGX_A100, DGX_A100.render(tabs=False)),
    # A paste kept as comments in a script, and one quoted in a reply.
    "dgx1_hash_commented": (
        DGX1,
        DGX1.render(tabs=False, prompt="$ nvidia-smi topo -m", prefix="# "),
    ),
    "dgx_a100_quoted_reply": (DGX_A100, DGX_A100.render(tabs=True, fence=True, prefix="> ")),
}


def test_the_dgx1_table_is_the_hybrid_cube_mesh():
    lanes = {i: 0 for i in range(8)}
    for (a, b), count in DGX1_NVLINKS.items():
        lanes[a] += count
        lanes[b] += count
    assert lanes == {i: 6 for i in range(8)}  # a V100 SXM2 has six NVLinks, all used
    for quad in (range(4), range(4, 8)):
        assert all(pair in DGX1_NVLINKS for pair in combinations(quad, 2))
    assert all((i, i + 4) in DGX1_NVLINKS for i in range(4))
    assert sorted(DGX1_NVLINKS.values()).count(2) == 8
    no_nvlink = [(a, b) for a, b in combinations(GPUS, 2) if not nvlink_count(DGX1.link(a, b))]
    assert len(no_nvlink) == 12 and ("GPU0", "GPU5") in no_nvlink and ("GPU1", "GPU4") in no_nvlink


def test_the_dgx_a100_table_has_two_nics_per_gpu_pair_and_a_far_storage_pair():
    for i, gpu in enumerate(GPUS):
        near = [n for n in DGX_A100.devices[8:] if DGX_A100.link(gpu, n) == "PXB"]
        assert near == [f"NIC{2 * (i // 2)}", f"NIC{2 * (i // 2) + 1}"]
        assert DGX_A100.link(gpu, "NIC8") == DGX_A100.link(gpu, "NIC9") == "SYS"
    assert DGX_A100.link("NIC8", "NIC9") == "PIX"


@pytest.mark.parametrize("name", RENDERINGS)
def test_each_rendering_parses_back_to_its_table(name):
    made, text = RENDERINGS[name]
    topo = parse_topology(text)
    assert topo.devices == made.devices
    assert topo.matrix == made.matrix()
    assert topo.affinity == made.expected_affinity()
    assert topo.nic_legend == made.nic_legend
    assert not topo.notes


def test_the_old_format_rendering_looks_like_nvidia_smi():
    lines = DGX1_TEXT.split("\n")
    assert lines[0].split() == [*GPUS, "mlx5_0", "CPU", "Affinity"]
    assert lines[1] == (
        "GPU0     X      NV1     NV1     NV2     NV2     SYS     SYS     SYS     NODE    0-19,40-59"
    )
    assert lines[9].startswith("mlx5_0  NODE    NODE    PIX     PIX     SYS")
    assert "NUMA Affinity" not in DGX1_TEXT and "NIC Legend" not in DGX1_TEXT
    assert DGX1_FOUR_HCAS_PROMPT_TEXT.startswith("$ nvidia-smi topo -m\n        GPU0    GPU1")
    assert DGX_A100_TEXT.startswith("```\n\tGPU0\tGPU1\t")
    assert "\nNIC8\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t" in DGX_A100_TEXT
