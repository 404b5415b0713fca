"""Property tests: any whitespace damage to a real paste parses to the same matrix, and any text at
all gives a parse or one clear parse error (the CLI: exit 0/1/2, never a traceback)."""

import contextlib
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstrain.doctor.ibstat import IbstatParseError, parse_ibstat
from dstrain.doctor.topology import TopologyParseError, parse_topology
from tests.conftest import REPO, SHARED, run_cli
from tests.unit.test_doctor_made_topologies import RENDERINGS

# Committed issue-thread pastes, the layouts written down in test_doctor_made_topologies, and the
# shared DGX-1 paste when ../shared is beside the repository (a user's clone may not have it).
TOPO_FILES = sorted((REPO / "tests" / "fixtures" / "doctor" / "topo").glob("*.txt"))
SHARED_DGX1 = SHARED / "fixtures" / "topo" / "08_v100_sxm2_dgx1_hybrid_cube_mesh_dlperf.txt"
if SHARED_DGX1.is_file():
    TOPO_FILES.append(SHARED_DGX1)
TOPO = [path.read_text() for path in TOPO_FILES] + [text for _, text in RENDERINGS.values()]
IBSTAT = sorted((REPO / "tests" / "fixtures" / "doctor" / "ibstat").glob("*.txt"))
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# A run of blanks inside a line: what pasting rewrites (tabs <-> spaces, widths).
BLANKS = re.compile(r"[ \t]+")


def _reblank(text: str, choices: list[str]) -> str:
    """Every run of blanks replaced by the next choice (cycled): a non-empty mix of tabs/spaces."""
    runs = iter(choices * (len(BLANKS.findall(text)) // len(choices) + 1))
    return BLANKS.sub(lambda _: next(runs), text)


blank_runs = st.lists(st.sampled_from([" ", "  ", "\t", "\t\t", " \t", "        "]), min_size=1)


@SETTINGS
@given(text=st.sampled_from(TOPO), choices=blank_runs)
def test_any_blank_damage_parses_to_the_same_matrix(text, choices):
    original = parse_topology(text)
    damaged = parse_topology(_reblank(text, choices))
    assert damaged.matrix == original.matrix
    assert damaged.affinity == original.affinity
    assert damaged.nic_legend == original.nic_legend


@SETTINGS
@given(path=st.sampled_from(IBSTAT), choices=blank_runs)
def test_any_blank_damage_to_ibstat_reads_the_same_ports(path, choices):
    text = path.read_text()
    assert parse_ibstat(_reblank(text, choices)) == parse_ibstat(text)


# Text built from the parsers' own vocabulary, so that it often looks almost like a paste.
WORDS = st.sampled_from(
    ["GPU0", "GPU1", "GPU2", "NIC0", "mlx5_0", "X", "NV12", "SYS", "PIX", "NODE", "CPU", "NUMA",
     "Affinity", "Legend:", "NIC Legend:", "NIC0:", "CA", "'mlx5_0'", "Port", "1:", "State:",
     "Active", "Rate:", "400", "Link", "layer:", "InfiniBand", "0-15", "N/A", "```", "|", "#"]
)  # fmt: skip
SEPARATORS = st.sampled_from([" ", "\t", "\n", "\r\n", "  ", ""])
almost_pastes = st.lists(st.tuples(WORDS, SEPARATORS), max_size=60).map(
    lambda pairs: "".join(w + s for w, s in pairs)
)
any_text = st.one_of(almost_pastes, st.text(max_size=300))


@SETTINGS
@given(text=any_text)
def test_any_text_parses_or_gives_the_parse_error(text):
    try:
        topo = parse_topology(text)
    except TopologyParseError:
        pass
    else:
        assert topo.gpus
        topo.to_json()
    with contextlib.suppress(IbstatParseError):
        parse_ibstat(text)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=almost_pastes)
def test_the_cli_never_shows_a_traceback(tmp_path, text):
    path = tmp_path / "paste.txt"
    path.write_text(text)
    for flag in ("--topology-from", "--ib-from"):
        result = run_cli("doctor", flag, path, "--tp", "4")
        assert result.code in (0, 1, 2), result.err
        assert "Traceback" not in result.err + result.out
