"""Parse `nvidia-smi topo -m` into a matrix of links, as written, plus CPU/NUMA affinity.

Pasted output is damaged in predictable ways, so the parser reads tokens, not columns: tabs and
spaces are the same separator, header alignment is ignored, leading prompts/labels/comment marks
and markdown fences are skipped, a row wrapped onto the next line is joined back, cells run
together (`NV12NV12`) are split, and everything after the first matrix's `Legend:` is junk except
the `NIC Legend` (NIC0 -> mlx5_0), whose entries may be wrapped or split across lines.

Formats handled: the newer one (NIC0.. columns, `NIC Legend:`, `NUMA Affinity`, `GPU NUMA ID`) and
the older one (NIC columns named by device such as `mlx5_0`, `CPU Affinity` only).
"""

import re
from dataclasses import dataclass, field
from typing import Any

LINK = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
LINK_PIECE = re.compile(r"NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|X")
GPU_NAME = re.compile(r"^GPU\d+$")
LEGEND_TITLE = re.compile(r"NIC\s+Legend")
NIC_LEGEND = re.compile(r"\b(NIC\d+)\s*:\s*(?!NIC\d)([A-Za-z0-9_.\-]+)")
AFFINITY = re.compile(r"^([\d,\-]+|N/A)$")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Leading marks a paste picks up: comment or quote prefixes, a markdown table's bars.
PREFIX = re.compile(r"^\s*[#>]+")
# Header labels after the device columns, in nvidia-smi's spelling -> our key.
LABELS = {
    ("CPU", "Affinity"): "cpu",
    ("NUMA", "Affinity"): "numa",
    ("GPU", "NUMA", "ID"): "gpu_numa_id",
}
# PCIe distance, nearest first (nvidia-smi's legend order); SOC is the pre-2017 name of SYS.
PCIE_RANK = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5}


class TopologyParseError(ValueError):
    """The text holds no `nvidia-smi topo -m` matrix."""


@dataclass
class Topology:
    """`matrix[(a, b)]` is the link between devices a and b exactly as written (`NV12`, `SYS`)."""

    devices: list[str]
    matrix: dict[tuple[str, str], str]
    affinity: dict[str, dict[str, str]] = field(default_factory=dict)
    nic_legend: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> list[str]:
        return sorted((d for d in self.devices if GPU_NAME.match(d)), key=lambda d: int(d[3:]))

    @property
    def nics(self) -> list[str]:
        return [d for d in self.devices if not GPU_NAME.match(d)]

    def link(self, a: str, b: str) -> str | None:
        return self.matrix.get((a, b))

    def nic_name(self, nic: str) -> str:
        """`mlx5_0 (NIC0)` in the new format, the column name in the old one."""
        name = self.nic_legend.get(nic)
        return f"{name} ({nic})" if name else nic

    def to_json(self) -> dict[str, Any]:
        matrix = {
            a: {b: self.matrix[(a, b)] for b in self.devices if (a, b) in self.matrix}
            for a in self.devices
        }
        return {
            "devices": self.devices,
            "gpus": self.gpus,
            "nics": self.nics,
            "matrix": matrix,
            "affinity": self.affinity,
            "nic_legend": self.nic_legend,
            "notes": self.notes,
        }


def nvlink_count(link: str | None) -> int:
    """The number of bonded NVLinks of a cell (`NV12` -> 12); 0 for PCIe paths."""
    match = re.fullmatch(r"NV(\d+)", link or "")
    return int(match.group(1)) if match else 0


def pcie_rank(link: str | None) -> int:
    """1 (PIX, nearest) .. 5 (SYS); NVLink and unknown cells rank 0."""
    return PCIE_RANK.get(link or "", 0)


def parse_topology(text: str) -> Topology:
    """The first `nvidia-smi topo -m` matrix in `text`; TopologyParseError if there is none."""
    lines = _clean_lines(text)
    for index, line in enumerate(lines):
        header = _header(line, lines[index + 1] if index + 1 < len(lines) else "")
        if header is None:
            continue
        topology = _parse_block(lines, index + 1, *header)
        if topology is not None:
            topology.nic_legend = _nic_legend(lines, topology.devices)
            return topology
    raise TopologyParseError(
        "no `nvidia-smi topo -m` matrix found (no header line with GPU0 followed by rows "
        "of links such as NV12, PIX, SYS)"
    )


def _clean_lines(text: str) -> list[str]:
    text = ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return [PREFIX.sub("", line.replace("|", " ")) for line in text.split("\n")]


def _header(line: str, next_line: str) -> tuple[list[str], list[str]] | None:
    """(device columns, affinity keys) when `line` is a matrix header, else None."""
    tokens = line.split()
    if "GPU0" not in tokens:
        return None
    tokens = tokens[tokens.index("GPU0") :]
    if len(tokens) > 1 and LINK.match(tokens[1]):
        return None  # a row (`GPU0  X  NV12 ...`), not the header
    more = next_line.split()
    if not any(map(_label_at, _tails(tokens))) and _wraps(more):
        tokens += more  # a header wrapped by the terminal: `... NIC5` / `NIC6 ... CPU Affinity`
    devices: list[str] = []
    while tokens and not _label_at(tokens):
        devices.append(tokens.pop(0))
    return devices, _labels(tokens)


def _tails(tokens: list[str]) -> list[list[str]]:
    return [tokens[i:] for i in range(len(tokens))]


def _wraps(tokens: list[str]) -> bool:
    """A header's continuation: names and labels only, no link cells, no legend `=`."""
    return bool(tokens) and not any(LINK.match(t) or "=" in t for t in tokens)


def _label_at(tokens: list[str]) -> bool:
    return any(tuple(tokens[: len(label)]) == label for label in LABELS)


def _labels(tokens: list[str]) -> list[str]:
    keys = []
    while tokens:
        for label, key in LABELS.items():
            if tuple(tokens[: len(label)]) == label:
                keys.append(key)
                tokens = tokens[len(label) :]
                break
        else:
            tokens = tokens[1:]
    return keys


def _parse_block(
    lines: list[str], start: int, devices: list[str], labels: list[str]
) -> Topology | None:
    rows: dict[str, tuple[list[str], list[str]]] = {}
    notes: list[str] = []
    index = start
    while index < len(lines):
        tokens = lines[index].split()
        index += 1
        if not tokens:
            continue
        if tokens[0].rstrip(":") == "Legend" or _header(lines[index - 1], "") is not None:
            break
        name = tokens[0].rstrip(":")
        if name not in devices:
            last = next(reversed(rows), None)
            if last is not None and not rows[last][1] and AFFINITY.match(tokens[0]):
                rows[last] = (rows[last][0], tokens)  # the affinity columns wrapped
            if rows and len(rows) == len(devices):
                break
            continue
        if name in rows:
            break  # a second matrix
        cells, rest = _split_cells(tokens[1:], len(devices))
        if not cells:
            continue  # prose that happens to start with a device name
        # A row wrapped by the terminal or the paste continues on the next line(s).
        while (
            len(cells) < len(devices)
            and not rest  # the row ran out of tokens, rather than hit one that is no link
            and index < len(lines)
            and _continues(lines[index], devices)
        ):
            more, rest = _split_cells(rest + lines[index].split(), len(devices) - len(cells))
            cells += more
            index += 1
        rows[name] = (cells, rest)
    # A real matrix has links beyond the self cell (a `topo -p2p` one has OK/NS cells instead).
    wanted = min(2, len(devices))
    if not any(GPU_NAME.match(name) and len(cells) >= wanted for name, (cells, _) in rows.items()):
        return None
    return _assemble(devices, labels, rows, notes)


def _continues(line: str, devices: list[str]) -> bool:
    tokens = line.split()
    return bool(tokens) and tokens[0].rstrip(":") not in devices and tokens[0] != "Legend:"


def _split_cells(tokens: list[str], wanted: int) -> tuple[list[str], list[str]]:
    """The first `wanted` link cells (splitting run-together ones) and the tokens after them."""
    cells: list[str] = []
    for position, token in enumerate(tokens):
        if len(cells) >= wanted:
            return cells, tokens[position:]
        if LINK.match(token):
            cells.append(token)
        elif "".join(pieces := LINK_PIECE.findall(token)) == token and pieces:
            cells += pieces
        else:
            return cells, tokens[position:]
    return cells, []


def _assemble(
    devices: list[str],
    labels: list[str],
    rows: dict[str, tuple[list[str], list[str]]],
    notes: list[str],
) -> Topology:
    matrix: dict[tuple[str, str], str] = {}
    affinity: dict[str, dict[str, str]] = {}
    for name, (cells, rest) in rows.items():
        if len(cells) == len(devices) - 1 and "X" not in cells:
            cells.insert(devices.index(name), "X")  # the self cell got lost in the paste
        if len(cells) != len(devices):
            notes.append(f"row {name} has {len(cells)} of {len(devices)} cells (damaged paste?)")
        for column, cell in zip(devices, cells, strict=False):
            if column != name:
                matrix[(name, column)] = cell
        if GPU_NAME.match(name) and labels and rest:
            affinity[name] = dict(zip(labels, rest, strict=False))
    missing = [d for d in devices if d not in rows]
    if missing:
        notes.append(f"no row for {', '.join(missing)}; links filled in from their columns")
    for a in devices:  # the matrix is symmetric: a truncated paste loses nothing it shows once
        for b in devices:
            if a != b and (a, b) not in matrix and (b, a) in matrix:
                matrix[(a, b)] = matrix[(b, a)]
    return Topology(devices, matrix, affinity, {}, notes)


def _nic_legend(lines: list[str], devices: list[str]) -> dict[str, str]:
    text = "\n".join(lines)
    start = LEGEND_TITLE.search(text)  # any blanks between the words: pastes rewrite them
    if start is None:
        return {}
    return {nic: name for nic, name in NIC_LEGEND.findall(text[start.end() :]) if nic in devices}
