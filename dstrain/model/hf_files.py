"""The files of a Hugging Face checkpoint folder, known from their headers alone: which tensor
lives in which file, with what dtype and shape, and whether the files are whole.

Why our own parser rather than `safetensors.safe_open`: a safetensors file is an 8-byte
little-endian header length, a JSON header (name -> dtype, shape, data offsets) and the data; a
check before launch needs to say *what* is wrong with a file (cut short, a header whose length
prefix lies, offsets that disagree with the shape, a shard the index names but the folder lacks,
an index that places a tensor in the wrong file), which `safe_open` reports as one opaque error,
and it must read nothing but the headers: DeepSeek-V3's 163 files hold 689 GB of data and
about 5 MB of headers. The data itself is read with `safe_open` (`hf_load.HFCheckpoint`).

Every problem is collected (`Problem`), none raised: the caller reports them all at once.
"""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

INDEX = "model.safetensors.index.json"
# safetensors' own dtype names and their sizes; what the loader can read is a subset (`FLOATS`).
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOATS = ("F32", "BF16", "F16")  # read as they are
FP8 = "F8_E4M3"  # read with its block scales (DeepSeek-V3's release)
MAX_HEADER_BYTES = 100 * 2**20  # safetensors refuses longer headers too


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint. `kind`: file (framing), index, missing, extra, shape,
    dtype, scale. `name`: the tensor or file it is about."""

    kind: str
    name: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Headers:
    """A checkpoint folder as its headers describe it; `problems` with its files and index."""

    folder: Path
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    # The index's placement of each tensor, and the files it names that are absent or whose
    # header cannot be read: their tensors are reported once, as that file's problem.
    index: dict[str, str] = field(default_factory=dict)
    unreadable: set[str] = field(default_factory=set)

    def lost_with_file(self, name: str) -> bool:
        return self.index.get(name) in self.unreadable

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_headers(folder: Path) -> Headers:
    """The headers of every file the index names (without an index, of every *.safetensors),
    checked against the index and against each file's size."""
    headers = Headers(folder, config=_config(folder))
    weight_map = _weight_map(folder, headers.problems)
    headers.index = weight_map or {}
    if weight_map is None:
        files = sorted(folder.glob("*.safetensors"))
    else:
        files = [folder / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.exists():
            named = sum(1 for f in (weight_map or {}).values() if f == file.name)
            headers.problems.append(
                Problem("file", file.name, f"named by {INDEX} for {named} tensor(s), not found")
            )
            headers.unreadable.add(file.name)
            continue
        headers.files.append(file)
        entries = _file_entries(file, headers.problems)
        if entries is None:
            headers.unreadable.add(file.name)
            continue
        for name, entry in entries.items():
            if name in headers.tensors:
                other = headers.tensors[name].file.name
                headers.problems.append(Problem("index", name, f"in both {other} and {file.name}"))
            headers.tensors[name] = entry
    if weight_map is not None:
        _check_index(weight_map, headers)
    return headers


def _config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _weight_map(folder: Path, problems: list[Problem]) -> dict[str, str] | None:
    path = folder / INDEX
    if not path.exists():
        return None
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, OSError) as exc:
        problems.append(
            Problem("index", INDEX, f"unreadable ({type(exc).__name__}): no weight_map")
        )
        return None
    return {str(k): str(v) for k, v in weight_map.items()}


def _check_index(weight_map: dict[str, str], headers: Headers) -> None:
    """The index and the headers agree: each tensor is in the file the index names, and every
    tensor of the files is in the index."""
    present = {f.name for f in headers.files}
    for name, file in weight_map.items():
        entry = headers.tensors.get(name)
        if entry is None:
            if file in present and file not in headers.unreadable:
                headers.problems.append(
                    Problem("index", name, f"{INDEX} places it in {file}, whose header lacks it")
                )
        elif entry.file.name != file:
            headers.problems.append(
                Problem("index", name, f"{INDEX} places it in {file}; it is in {entry.file.name}")
            )
    for name, entry in headers.tensors.items():
        if name not in weight_map:
            headers.problems.append(Problem("index", name, f"in {entry.file.name}, not in {INDEX}"))


def _file_entries(file: Path, problems: list[Problem]) -> dict[str, TensorEntry] | None:
    """The tensors of one file's header; framing problems go to `problems`. None: the header
    cannot be read."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            problems.append(
                Problem("file", file.name, f"{size} bytes: too short to be safetensors")
            )
            return None
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8 or length > MAX_HEADER_BYTES:
            problems.append(
                Problem(
                    "file",
                    file.name,
                    f"its 8-byte prefix gives the header {length:,} bytes; the file has "
                    f"{size - 8:,} after the prefix: the prefix lies, or the file is cut short",
                )
            )
            return None
        raw = handle.read(length)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        problems.append(Problem("file", file.name, f"its header is not valid JSON ({exc})"))
        return None
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    entries: dict[str, TensorEntry] = {}
    beyond: list[str] = []
    for name, spec in header.items():
        entry = _entry(file, name, spec, problems)
        if entry is None:
            continue
        if spec["data_offsets"][1] > data_size:
            beyond.append(name)
        entries[name] = entry
    if beyond:
        problems.append(
            Problem(
                "file",
                file.name,
                f"truncated: {size:,} bytes, but its header places {len(beyond)} tensor(s) "
                f"past the end (first {beyond[0]})",
            )
        )
    return entries


def _entry(file: Path, name: str, spec: object, problems: list[Problem]) -> TensorEntry | None:
    try:
        dtype = str(spec["dtype"])  # type: ignore[index]
        shape = tuple(int(n) for n in spec["shape"])  # type: ignore[index]
        begin, end = (int(n) for n in spec["data_offsets"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        problems.append(Problem("file", name, f"{file.name}'s header entry is malformed: {spec}"))
        return None
    numel = 1
    for n in shape:
        numel *= n
    itemsize = DTYPE_BYTES.get(dtype)
    if itemsize is not None and end - begin != numel * itemsize:
        problems.append(
            Problem(
                "file",
                name,
                f"{file.name}'s header gives it {end - begin:,} bytes; {dtype} {list(shape)} "
                f"takes {numel * itemsize:,}",
            )
        )
        return None
    return TensorEntry(file, dtype, shape, end - begin)
