"""`nvidia-smi topo -m` parsing on recorded outputs of real machines (pastes from public issue
threads), on layouts written down by hand (test_doctor_made_topologies), and on the damage pastes do
to them (derived here from both)."""

from pathlib import Path

import pytest
import yaml

from dstrain.doctor.topology import TopologyParseError, nvlink_count, parse_topology
from tests.conftest import REPO, SHARED
from tests.unit.test_doctor_made_topologies import (
    DGX1,
    DGX1_FOUR_HCAS_PROMPT_TEXT,
    DGX1_TEXT,
    DGX_A100_TEXT,
)

FIXTURES = REPO / "tests" / "fixtures" / "doctor" / "topo"
SAMPLES = yaml.safe_load((FIXTURES / "index.yaml").read_text())["samples"]
# Samples the parser reads whole; the others (`strict: false`) have a test of their own below.
STRICT = [s for s in SAMPLES if s.get("strict", True)]
# Extra coverage when the shared fixtures sit beside the repository (skipped otherwise).
DGX1_SHARED = SHARED / "fixtures" / "topo" / "08_v100_sxm2_dgx1_hybrid_cube_mesh_dlperf.txt"


def _text(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("sample", STRICT, ids=[s["file"][:2] for s in STRICT])
def test_recorded_samples_parse_to_their_index_facts(sample):
    topo = parse_topology(_text(sample["file"]))
    gpus = topo.gpus
    assert len(gpus) == sample["num_gpus"]
    assert len(topo.nics) == sample["num_nics"]
    assert topo.link("GPU0", "GPU1") == sample["gpu0_gpu1"]
    assert topo.link("GPU0", gpus[-1]) == sample["gpu0_last_gpu"]
    numa = [topo.affinity.get(g, {}).get("numa") for g in (gpus[0], gpus[-1])]
    assert numa == sample["numa"]
    for nic, name in sample.get("nic_legend", {}).items():
        assert topo.nic_legend[nic] == name
    for gpu, nic in sample.get("gpu_nic_pix", {}).items():
        assert topo.link(gpu, nic) == "PIX"
    missing = sample.get("missing_rows")
    if missing:  # a paste cut short: the rows it lost are named, and nothing else is wrong
        note = f"no row for {', '.join(missing)}; links filled in from their columns"
        assert topo.notes == [note]
        assert not any(topo.affinity.get(d) for d in missing)
    else:
        assert not topo.notes  # nothing was missing or damaged beyond repair
    # Every pair of devices has a cell, and the matrix is symmetric.
    for a in topo.devices:
        for b in topo.devices:
            if a != b:
                assert topo.link(a, b) == topo.link(b, a), (a, b)


def test_a_paste_with_run_together_affinity_cells_keeps_its_matrix():
    """01: in the GPU0-GPU3 rows the CPU and NUMA affinity cells ran together (`0-45,92-1370`).
    The parser cannot tell those apart (see the index's parser_issue), so only what it reads
    right is asserted: the whole matrix, the legend and the rows the damage spared."""
    (sample,) = [s for s in SAMPLES if not s.get("strict", True)]
    topo = parse_topology(_text(sample["file"]))
    assert len(topo.gpus) == sample["num_gpus"] and len(topo.nics) == sample["num_nics"]
    assert topo.link("GPU0", "GPU1") == sample["gpu0_gpu1"]
    assert topo.link("GPU0", "GPU7") == sample["gpu0_last_gpu"]
    assert all(topo.link(a, b) == "NV18" for a in topo.gpus for b in topo.gpus if a != b)
    for nic, name in sample["nic_legend"].items():
        assert topo.nic_legend[nic] == name
    for gpu, nic in sample["gpu_nic_pix"].items():
        assert topo.link(gpu, nic) == "PIX"
    for nic in sample["far_nics"]:
        assert {topo.link(nic, gpu) for gpu in topo.gpus} == {"SYS"}
    assert topo.link("NIC9", "GPU0") == "PXB" and topo.link("NIC9", "GPU4") == "SYS"
    for gpu in ("GPU4", "GPU5", "GPU6", "GPU7"):
        assert topo.affinity[gpu] == sample["affinity_read_right"]["GPU4"]
    assert not topo.notes


def test_made_dgx1_parses_to_the_hybrid_cube_mesh():
    topo = parse_topology(DGX1_TEXT)
    assert topo.gpus == [f"GPU{i}" for i in range(8)]
    assert topo.nics == ["mlx5_0"]
    # The hybrid cube mesh: NV2 between GPU0-GPU3 and GPU0-GPU4, nothing between GPU0-GPU5.
    assert [topo.link("GPU0", f"GPU{i}") for i in range(1, 8)] == [
        "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS",
    ]  # fmt: skip
    assert topo.link("GPU1", "GPU4") == "SYS" and topo.link("GPU1", "GPU5") == "NV2"
    assert topo.link("mlx5_0", "GPU2") == "PIX"
    assert topo.affinity["GPU0"] == {"cpu": "0-19,40-59"}
    assert topo.affinity["GPU7"] == {"cpu": "20-39,60-79"}
    assert topo.matrix == DGX1.matrix()


def test_old_format_nic_columns_named_by_device_behind_a_prompt():
    topo = parse_topology(DGX1_FOUR_HCAS_PROMPT_TEXT)
    assert topo.nics == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert topo.nic_legend == {} and topo.nic_name("mlx5_2") == "mlx5_2"
    assert topo.link("GPU5", "mlx5_2") == "PIX" and topo.link("mlx5_0", "mlx5_1") == "PHB"
    assert topo.affinity["GPU4"] == {"cpu": "20-39,60-79"}
    # The same naming in a real (truncated) paste: mlx5_0/mlx5_1 columns, CPU Affinity only.
    real = parse_topology(_text("07_v100_sxm2_8gpu_cube_mesh_mlx5_columns_truncated.txt"))
    assert real.nics == ["mlx5_0", "mlx5_1"] and real.link("GPU2", "mlx5_1") == "PIX"
    assert real.affinity["GPU4"] == {"cpu": "24-47,72-95"}


def test_shared_dgx1_fixture_parses_per_its_index(shared):
    index = yaml.safe_load((DGX1_SHARED.parent / "index.yaml").read_text())["samples"][0]
    topo = parse_topology(DGX1_SHARED.read_text())
    assert len(topo.gpus) == index["num_gpus"] == 8
    assert topo.nics == ["mlx5_0"]
    assert topo.link("GPU0", "GPU1") == index["gpu0_gpu1"] == "NV1"
    assert topo.link("GPU0", "GPU7") == "SYS"
    # The hybrid cube mesh: NV2 between GPU0-GPU3 and GPU0-GPU4, nothing between GPU0-GPU5.
    assert [topo.link("GPU0", f"GPU{i}") for i in range(1, 8)] == [
        "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS",
    ]  # fmt: skip
    assert topo.link("mlx5_0", "GPU2") == "PIX"
    assert topo.affinity["GPU0"] == {"cpu": "0-11,24-35"}
    assert topo.affinity["GPU7"] == {"cpu": "12-23,36-47"}


def test_cells_and_affinities_of_a_dgx_a100():
    topo = parse_topology(DGX_A100_TEXT)  # tab-separated, fenced, ten NICs
    assert topo.devices[:3] == ["GPU0", "GPU1", "GPU2"]
    assert topo.link("GPU4", "NIC4") == "PXB"
    assert topo.link("NIC8", "NIC9") == "PIX"
    assert topo.affinity["GPU4"] == {"cpu": "112-127,240-255", "numa": "7"}
    assert topo.nic_name("NIC3") == "mlx5_3 (NIC3)"
    assert nvlink_count(topo.link("GPU2", "GPU5")) == 12
    # A real DGX A100 paste (cut after GPU5), `# nvidia-smi topo -m` root prompt in the fence.
    real = parse_topology(_text("08_dgx_a100_nv12_10nic_root_prompt_truncated.txt"))
    assert real.link("GPU4", "NIC4") == "PXB" and real.link("NIC8", "GPU5") == "SYS"
    assert real.affinity["GPU4"] == {"cpu": "112-127,240-255", "numa": "7", "gpu_numa_id": "N/A"}
    assert nvlink_count(real.link("GPU2", "GPU5")) == 12
    assert real.link("GPU0", "GPU7") == "NV12"  # GPU7's row is lost; its column is not


def test_h100_gpu_numa_id_column_and_json_shape():
    topo = parse_topology(_text("02_dgx_h100_nv18_8nic_sglang_env.txt"))
    assert topo.affinity["GPU5"] == {"cpu": "48-95,144-191", "numa": "1", "gpu_numa_id": "N/A"}
    data = topo.to_json()
    assert data["matrix"]["GPU0"]["GPU1"] == "NV18"
    assert data["matrix"]["NIC3"]["GPU3"] == "PIX"
    assert "GPU0" not in data["matrix"]["GPU0"]  # no self cell
    assert data["nic_legend"]["NIC5"] == "mlx5_5"


def test_p2p_matrix_after_the_legend_is_not_taken_for_the_topology():
    topo = parse_topology(_text("06_2gpu_node_indented_wrapped_legend.txt"))
    assert topo.matrix == {("GPU0", "GPU1"): "NODE", ("GPU1", "GPU0"): "NODE"}


def _tabs_to_spaces(text: str) -> str:
    return text.expandtabs(8)


def _spaces_to_tabs(text: str) -> str:
    return "\n".join("\t".join(line.split("    ")) for line in text.split("\n"))


def _crlf(text: str) -> str:
    return text.replace("\n", "\r\n")


def _fenced_with_prompt(text: str) -> str:
    return "user@node01:~$ nvidia-smi topo -m\n```text\n" + text + "```\nuser@node01:~$ \n"


def _leading_tabs(text: str) -> str:
    return "\n".join("\t" + line if line.strip() else line for line in text.split("\n"))


def _wrapped_legend(text: str) -> str:
    """The NIC legend reflowed: entries run together, one split across two lines."""
    return text.replace("  NIC0: mlx5_0\n  NIC1: mlx5_1\n", "  NIC0: mlx5_0  NIC1:\nmlx5_1\n")


def _trailing_junk(text: str) -> str:
    return text + "\n(base) root@gpu-node:~# ls\nNIC Legend? GPU0 looks fine\n\x1b[0m"


def _header_index(lines: list[str]) -> int:
    return next(i for i, line in enumerate(lines) if "GPU1" in line and "X" not in line)


def _misaligned_header(text: str) -> str:
    lines = text.split("\n")
    index = _header_index(lines)
    lines[index] = " ".join(lines[index].split())
    return "\n".join(lines)


def _tab_indented_header(text: str) -> str:
    """The header's leading blanks turned into two tabs, the rest left space-aligned."""
    lines = text.split("\n")
    index = _header_index(lines)
    lines[index] = "\t\t" + lines[index].lstrip(" \t")
    return "\n".join(lines)


def _hash_commented(text: str) -> str:
    """The paste kept as comments at the top of a script."""
    return "\n".join("# " + line if line.strip() else "#" for line in text.split("\n"))


def _quoted_reply(text: str) -> str:
    """The paste quoted in a reply (`> ` on every line, `>` on blank ones)."""
    return "\n".join("> " + line if line.strip() else ">" for line in text.split("\n"))


DAMAGE = [
    _tabs_to_spaces,
    _spaces_to_tabs,
    _crlf,
    _fenced_with_prompt,
    _leading_tabs,
    _wrapped_legend,
    _trailing_junk,
    _misaligned_header,
    _tab_indented_header,
    _hash_commented,
    _quoted_reply,
]
PASTES = {
    "01_h800": _text("01_h800_nv18_10nic_far_nic_sglang_env.txt"),
    "02_h100": _text("02_dgx_h100_nv18_8nic_sglang_env.txt"),
    "05_rtx": _text("05_rtx5090_4090_5gpu_two_numa.txt"),
    "07_v100_truncated": _text("07_v100_sxm2_8gpu_cube_mesh_mlx5_columns_truncated.txt"),
    "08_a100_truncated": _text("08_dgx_a100_nv12_10nic_root_prompt_truncated.txt"),
    "made_dgx_a100": DGX_A100_TEXT,
    "made_dgx1": DGX1_TEXT,
    "made_dgx1_prompt": DGX1_FOUR_HCAS_PROMPT_TEXT,
}


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__.strip("_") for d in DAMAGE])
@pytest.mark.parametrize("name", PASTES)
def test_damaged_pastes_parse_like_the_original(name, damage):
    original = parse_topology(PASTES[name])
    damaged = parse_topology(damage(PASTES[name]))
    assert damaged.matrix == original.matrix
    assert damaged.affinity == original.affinity
    assert damaged.nic_legend == original.nic_legend
    assert damaged.notes == original.notes


def test_a_commented_paste_with_a_wrapped_legend_and_stray_blanks():
    """Kept as `#` comments in a job script: every line prefixed, the NIC legend reflowed, a
    blank after some cells' tab, a row's first cell glued to its name by a single space."""
    text = DGX_A100_TEXT.replace("GPU1\tNV12", "GPU1\t NV12").replace("NIC4\tSYS", "NIC4 SYS")
    assert "GPU1\t NV12" in text and "\nNIC4 SYS" in text
    damaged = _hash_commented(_wrapped_legend(text))
    assert parse_topology(damaged).matrix == parse_topology(DGX_A100_TEXT).matrix
    assert parse_topology(damaged).nic_legend == parse_topology(DGX_A100_TEXT).nic_legend


def test_damage_to_the_old_format_shared_fixture(shared):
    text = DGX1_SHARED.read_text()
    original = parse_topology(text)
    for damage in DAMAGE:
        assert parse_topology(damage(text)).matrix == original.matrix, damage.__name__


def test_a_row_wrapped_onto_the_next_line_is_joined():
    text = _text("02_dgx_h100_nv18_8nic_sglang_env.txt")
    row = next(line for line in text.split("\n") if line.startswith("GPU3"))
    cut = row.index("SYS")
    wrapped = text.replace(row, row[:cut] + "\n" + row[cut:])
    topo = parse_topology(wrapped)
    assert topo.link("GPU3", "NIC7") == "SYS"
    assert topo.affinity["GPU3"]["cpu"] == "0-47,96-143"
    assert not topo.notes


def test_run_together_cells_are_split():
    text = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV4NV4\t0-7\nGPU1\tNV4\t X \tNV4\t0-7\n"
    topo = parse_topology(text + "GPU2\tNV4\tNV4\t X \t8-15\n")
    assert topo.link("GPU0", "GPU2") == "NV4"
    assert topo.affinity["GPU0"] == {"cpu": "0-7"}


def test_a_truncated_paste_keeps_what_it_shows_and_says_so():
    text = DGX_A100_TEXT
    cut = text[: text.index("GPU5\tNV12")]
    topo = parse_topology(cut)
    assert len(topo.gpus) == 8
    assert topo.link("GPU6", "GPU0") == "NV12"  # filled in from GPU0's row
    assert any("GPU5" in note for note in topo.notes)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "$ nvidia-smi topo -m\n"
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver",
        "CA 'mlx5_0'\n\tCA type: MT4123\n",
        "\tGPU0\tGPU1\nGPU0\t X \tOK\nGPU1\tOK\t X \n",  # a `topo -p2p` matrix, not links
    ],
)
def test_text_without_a_matrix_is_an_error(text):
    with pytest.raises(TopologyParseError, match="no `nvidia-smi topo -m` matrix"):
        parse_topology(text)


def test_fixture_paths_exist():
    assert all((FIXTURES / s["file"]).is_file() for s in SAMPLES)
    assert len(SAMPLES) >= 6
    assert isinstance(FIXTURES, Path)


def test_a_header_wrapped_by_the_terminal_is_joined():
    text = _text("02_dgx_h100_nv18_8nic_sglang_env.txt")
    wrapped = text.replace("NIC3    NIC4", "NIC3\n        NIC4", 1)
    assert parse_topology(wrapped).matrix == parse_topology(text).matrix
    assert parse_topology(wrapped).affinity == parse_topology(text).affinity


def test_a_markdown_table_paste():
    text = (
        "| | GPU0 | GPU1 | NIC0 | CPU Affinity | NUMA Affinity |\n"
        "|---|---|---|---|---|---|\n"
        "| GPU0 | X | NV4 | PIX | 0-31 | 0 |\n"
        "| GPU1 | NV4 | X | SYS | 32-63 | 1 |\n"
        "| NIC0 | PIX | SYS | X | | |\n"
    )
    topo = parse_topology(text + "\nNIC Legend:\n\n  NIC0: mlx5_2\n")
    assert topo.link("GPU0", "GPU1") == "NV4" and topo.link("NIC0", "GPU1") == "SYS"
    assert topo.affinity["GPU1"] == {"cpu": "32-63", "numa": "1"}
    assert topo.nic_name("NIC0") == "mlx5_2 (NIC0)"


def test_ansi_underlined_header_and_prose_after_the_matrix():
    text = _text("04_rtx5090_2gpu_phb_tabs.txt").replace(
        "GPU0\tGPU1", "\x1b[4mGPU0\tGPU1\x1b[0m", 1
    )
    topo = parse_topology(text.replace("```\n", "", 1) + "GPU1 runs hot, GPU0 is fine\n")
    assert topo.matrix == {("GPU0", "GPU1"): "PHB", ("GPU1", "GPU0"): "PHB"}


def test_a_lost_self_cell_is_put_back():
    text = _text("05_rtx5090_4090_5gpu_two_numa.txt")
    damaged = text.replace("GPU2    SYS     PHB      X      NODE", "GPU2    SYS     PHB     NODE")
    assert damaged != text
    assert parse_topology(damaged).matrix == parse_topology(text).matrix
