"""The sparse release replica is a faithful, valid, nearly free copy of the release's structure.

Each file is checked twice: by the small reader below (independent of the writer) and by the real
``safetensors`` library on a few files.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.release_replica import (
    INDEX_NAME,
    corrupt,
    release_tensors,
    sparse_files_supported,
    write_release,
)

ITEMSIZE = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "I16": 2, "F32": 4}
MIB = 1 << 20


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    if not sparse_files_supported(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem does not keep truncated files sparse")
    return tmp_path / "release"


def parse(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Read and validate one safetensors file; returns name -> (dtype, shape) in data order."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        assert 8 + length <= size, f"{path.name}: header of {length} bytes runs past the end"
        raw = f.read(length)
    assert (8 + length) % 8 == 0, f"{path.name}: header not padded to 8 bytes"
    header = json.loads(raw)
    assert header.pop("__metadata__") == {"format": "pt"}
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    offset = 0
    for name, entry in entries:
        begin, end = entry["data_offsets"]
        assert begin == offset, f"{path.name}: {name} not packed contiguously"
        assert end - begin == math.prod(entry["shape"]) * ITEMSIZE[entry["dtype"]], name
        offset = end
    assert 8 + length + offset == size, f"{path.name}: size {size} != 8 + {length} + {offset}"
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in entries}


def parse_folder(folder: Path) -> tuple[dict, dict[str, dict]]:
    """The index and every shard's parsed header, by file name."""
    index = json.loads((folder / INDEX_NAME).read_text())
    headers = {path.name: parse(path) for path in sorted(folder.glob("*.safetensors"))}
    return index, headers


def assert_index_agrees(index: dict, headers: dict[str, dict]) -> None:
    """Every tensor is in exactly one header, and the index names that file for it."""
    holder: dict[str, str] = {}
    for file_name, tensors in headers.items():
        for name in tensors:
            assert name not in holder, f"{name} in both {holder[name]} and {file_name}"
            holder[name] = file_name
    assert index["weight_map"] == holder
    data = sum(
        math.prod(shape) * ITEMSIZE[dtype] for t in headers.values() for dtype, shape in t.values()
    )
    assert index["metadata"]["total_size"] == data


def assert_library_reads(path: Path, expected: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """The real safetensors library opens ``path`` and sees the same names, shapes and dtypes."""
    with safe_open(path, framework="pt") as handle:
        assert set(handle.keys()) == set(expected)
        for name, (dtype, shape) in expected.items():
            piece = handle.get_slice(name)
            assert (piece.get_dtype(), tuple(piece.get_shape())) == (dtype, shape), name


def disk_and_logical(folder: Path) -> tuple[int, int]:
    files = list(folder.glob("*.safetensors"))
    return sum(os.stat(f).st_blocks * 512 for f in files), sum(f.stat().st_size for f in files)


def test_deepseek_v3_replica(folder: Path) -> None:
    start = time.perf_counter()
    replica = write_release(folder, "deepseek-v3")
    elapsed = time.perf_counter() - start
    on_disk, logical = disk_and_logical(folder)
    print(
        f"\nV3: {replica.files} files, {replica.tensors} tensors, {replica.params} params, "
        f"{replica.data_bytes} data bytes, {logical} logical bytes, {on_disk} on disk, "
        f"written in {elapsed:.2f}s"
    )

    assert (replica.files, replica.tensors) == (163, 91_991)
    assert 684.4e9 <= replica.params <= 684.6e9
    assert on_disk < 64 * MIB
    assert 688e9 < logical < 690e9
    assert json.loads((folder / "config.json").read_text()) == replica.config
    assert replica.config["num_hidden_layers"] == 61

    index, headers = parse_folder(folder)
    names = sorted(headers)
    assert names[0] == "model-00001-of-000163.safetensors"
    assert names[-1] == "model-00163-of-000163.safetensors"
    assert_index_agrees(index, headers)
    tensors = {name: entry for t in headers.values() for name, entry in t.items()}
    assert tensors == release_tensors("deepseek-v3")
    assert len(tensors) == replica.tensors
    assert sum(math.prod(shape) for _, shape in tensors.values()) == replica.params
    for file_name in (names[0], names[len(names) // 2], names[-1]):
        assert_library_reads(folder / file_name, headers[file_name])

    layer = "model.layers.{}.".format
    assert tensors[layer(0) + "self_attn.kv_a_proj_with_mqa.weight"] == ("F8_E4M3", (576, 7168))
    assert tensors[layer(0) + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ("F32", (5, 56))
    assert tensors[layer(61) + "eh_proj.weight"] == ("BF16", (7168, 14336))
    assert layer(61) + "eh_proj.weight_scale_inv" not in tensors
    assert tensors[layer(2) + "mlp.gate_proj.weight"] == ("F8_E4M3", (18432, 7168))
    assert layer(3) + "mlp.gate_proj.weight" not in tensors
    assert tensors[layer(3) + "mlp.gate.e_score_correction_bias"] == ("F32", (256,))
    assert tensors[layer(3) + "mlp.gate.weight"] == ("BF16", (256, 7168))
    assert layer(3) + "mlp.gate.weight_scale_inv" not in tensors
    assert tensors[layer(60) + "mlp.experts.255.down_proj.weight_scale_inv"] == ("F32", (56, 16))
    assert tensors[layer(61) + "shared_head.head.weight"] == ("BF16", (129280, 7168))
    assert layer(62) + "input_layernorm.weight" not in tensors
    scales = [n for n in tensors if n.endswith("_scale_inv")]
    assert all(tensors[n[: -len("_scale_inv")]][0] == "F8_E4M3" for n in scales)
    assert len(scales) == sum(dtype == "F8_E4M3" for dtype, _ in tensors.values())


def test_deepseek_v2_lite_replica(folder: Path) -> None:
    start = time.perf_counter()
    replica = write_release(folder, "deepseek-v2-lite")
    elapsed = time.perf_counter() - start
    print(
        f"\nV2-Lite: {replica.files} files, {replica.tensors} tensors, {replica.params} params, "
        f"{replica.data_bytes} data bytes, written in {elapsed:.3f}s"
    )

    assert replica.files == 4
    assert 15.6e9 <= replica.params <= 15.8e9
    index, headers = parse_folder(folder)
    assert sorted(headers) == [f"model-0000{i}-of-000004.safetensors" for i in range(1, 5)]
    assert_index_agrees(index, headers)
    tensors = {name: entry for t in headers.values() for name, entry in t.items()}
    assert len(tensors) == replica.tensors
    assert {dtype for dtype, _ in tensors.values()} == {"BF16"}
    assert not [n for n in tensors if n.endswith("_scale_inv") or "e_score_correction_bias" in n]
    assert not [n for n in tensors if n.startswith("model.layers.27.")]
    assert tensors["model.layers.0.self_attn.q_proj.weight"] == ("BF16", (3072, 2048))
    assert "model.layers.0.self_attn.q_a_proj.weight" not in tensors
    assert tensors["model.layers.0.mlp.down_proj.weight"] == ("BF16", (2048, 10944))
    assert tensors["model.layers.26.mlp.shared_experts.up_proj.weight"] == ("BF16", (2816, 2048))
    assert tensors["model.layers.26.mlp.experts.63.down_proj.weight"] == ("BF16", (2048, 1408))
    assert tensors["model.layers.1.mlp.gate.weight"] == ("BF16", (64, 2048))
    assert tensors["lm_head.weight"] == ("BF16", (102400, 2048))
    for file_name in headers:
        assert_library_reads(folder / file_name, headers[file_name])


def test_cut_v3_keeps_full_width_layers_and_renumbered_mtp(folder: Path) -> None:
    replica = write_release(folder, "deepseek-v3", layers=4)
    assert replica.files == math.ceil(replica.data_bytes / 5e9)
    assert replica.config["num_hidden_layers"] == 4
    assert replica.config["first_k_dense_replace"] == 3
    index, headers = parse_folder(folder)
    assert_index_agrees(index, headers)
    tensors = {name: entry for t in headers.values() for name, entry in t.items()}
    assert tensors["model.layers.4.eh_proj.weight"] == ("BF16", (7168, 14336))
    assert tensors["model.layers.3.mlp.experts.255.up_proj.weight"] == ("F8_E4M3", (2048, 7168))
    assert not [n for n in tensors if n.startswith("model.layers.5.")]
    assert disk_and_logical(folder)[0] < 4 * MIB


def library_error(path: Path) -> Exception | None:
    try:
        with safe_open(path, framework="pt") as handle:
            names = handle.keys()  # a safe_open handle is not iterable
            for name in names:
                handle.get_slice(name).get_shape()
    except Exception as error:  # noqa: BLE001 - any refusal counts
        return error
    return None


def files_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def test_corrupt_truncated(folder: Path) -> None:
    write_release(folder, "deepseek-v2-lite")
    last = files_of(folder)[-1]
    size = last.stat().st_size
    print(corrupt(folder, "truncated"))
    assert last.stat().st_size == size // 2
    assert library_error(last) is not None
    with pytest.raises(AssertionError, match="size"):
        parse(last)


def test_corrupt_header_length(folder: Path) -> None:
    write_release(folder, "deepseek-v2-lite")
    first = files_of(folder)[0]
    print(corrupt(folder, "header_length"))
    with open(first, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    assert 8 + length > first.stat().st_size
    assert library_error(first) is not None
    with pytest.raises(AssertionError, match="runs past the end"):
        parse(first)


def test_corrupt_missing_shard(folder: Path) -> None:
    write_release(folder, "deepseek-v2-lite")
    print(corrupt(folder, "missing_shard"))
    named = set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values())
    missing = [name for name in named if not (folder / name).exists()]
    assert len(missing) == 1 and len(files_of(folder)) == 3


def test_corrupt_wrong_file(folder: Path) -> None:
    write_release(folder, "deepseek-v2-lite")
    print(corrupt(folder, "wrong_file"))
    index, headers = parse_folder(folder)
    wrong = [n for n, f in index["weight_map"].items() if n not in headers[f]]
    assert len(wrong) == 1
    with pytest.raises(AssertionError):
        assert_index_agrees(index, headers)


def test_corrupt_scale_shape(folder: Path) -> None:
    write_release(folder, "deepseek-v3", layers=2)
    print(corrupt(folder, "scale_shape"))
    index, headers = parse_folder(folder)  # still valid files with a consistent index
    assert_index_agrees(index, headers)
    tensors = {name: entry for t in headers.values() for name, entry in t.items()}
    wrong = []
    for name, (_, shape) in tensors.items():
        if name.endswith("_scale_inv"):
            out, inp = tensors[name[: -len("_scale_inv")]][1]
            if shape != (math.ceil(out / 128), math.ceil(inp / 128)):
                wrong.append(name)
    assert len(wrong) == 1
    for file_name in headers:
        assert library_error(folder / file_name) is None


def test_corrupt_unknown_dtype(folder: Path) -> None:
    write_release(folder, "deepseek-v2-lite")
    print(corrupt(folder, "unknown_dtype"))
    index, headers = parse_folder(folder)
    assert_index_agrees(index, headers)
    relabelled = [n for t in headers.values() for n, (dtype, _) in t.items() if dtype == "I16"]
    assert len(relabelled) == 1
    first = files_of(folder)[0]
    assert_library_reads(first, headers[first.name])  # I16 is valid safetensors, foreign here
