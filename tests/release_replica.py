"""Sparse replicas of released DeepSeek checkpoint folders, for full-size structure tests.

A *replica* is a folder laid out like a Hugging Face release (``config.json``,
``model.safetensors.index.json`` and ``model-XXXXX-of-XXXXXX.safetensors`` shards) whose
safetensors files are real and valid: each holds the length prefix and JSON header with the
exact tensor names, dtypes and shapes of the release, and is extended to its full logical size
with ``truncate``. The data regions are holes, so a 689 GB DeepSeek-V3 folder takes a few
megabytes of disk and is written in seconds. Loaders can then be tested against the real
structure (every name, shape, dtype, FP8 scale and shard boundary) without real weights.

The tensor list is derived here, from the public architecture facts in the configs below and the
naming of the Hugging Face ``modeling_deepseek.py`` code, and deliberately imports nothing from
``dstrain``: the replica is an independent judge of dstrain's loader.

Only the standard library is used. ``corrupt`` damages a written replica in one named way, for
bad-checkpoint tests.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

ITEMSIZE: dict[str, int] = {"F8_E4M3": 1, "BF16": 2, "I16": 2, "F32": 4}
"""Bytes per element of each safetensors dtype used here."""

BLOCK = 128
"""FP8 block size: each ``weight_scale_inv`` holds one F32 per 128x128 block of its weight."""

INDEX_NAME = "model.safetensors.index.json"

DEEPSEEK_V3_CONFIG: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

DEEPSEEK_V2_LITE_CONFIG: dict = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.39.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

STRUCTURES: dict[str, tuple[dict, int]] = {
    "deepseek-v3": (DEEPSEEK_V3_CONFIG, 163),  # also what R1 and V3.1 ship
    "deepseek-v2-lite": (DEEPSEEK_V2_LITE_CONFIG, 4),
}
"""structure -> (config.json, number of safetensors files in the release)."""

CUT_SHARD_BYTES = 5 * 10**9
"""Shard size of cut (``layers=``) replicas, about a release shard (V3's average is 4.2 GB).
One big file would be unrealistic, and under heuristic overcommit safetensors cannot even
mmap a file larger than RAM (ENOMEM for a 31 GB file on a 24 GB host)."""

Tensors = dict[str, tuple[str, tuple[int, ...]]]
"""name -> (safetensors dtype, shape), in file order."""


@dataclass
class Replica:
    folder: Path
    files: int
    tensors: int
    params: int  # sum of numel over all tensors (scales included)
    data_bytes: int  # sum of data bytes over all tensors
    config: dict  # the config.json written


# --------------------------------------------------------------------------- tensor list


def release_config(structure: str, layers: int | None = None) -> dict:
    """The release's config.json; with ``layers``, cut to that many decoder layers."""
    config = json.loads(json.dumps(_structure(structure)[0]))  # deep copy
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ValueError(f"layers must be in 1..{config['num_hidden_layers']}, got {layers}")
        config["num_hidden_layers"] = layers
        config["first_k_dense_replace"] = min(config["first_k_dense_replace"], layers - 1)
    return config


def release_tensors(structure: str, layers: int | None = None) -> Tensors:
    """Every tensor of the release, in file order: embeddings, layers (MTP last), norm, head."""
    return tensors_for_config(release_config(structure, layers))


def tensors_for_config(config: dict) -> Tensors:
    """The Hugging Face tensor list a DeepSeek V2/V3 config implies."""
    tensors: Tensors = {}
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    decoder_layers = config["num_hidden_layers"]
    tensors["model.embed_tokens.weight"] = ("BF16", (vocab, hidden))
    for i in range(decoder_layers):
        tensors.update(_layer(config, i))
    for i in range(decoder_layers, decoder_layers + config.get("num_nextn_predict_layers", 0)):
        tensors.update(_mtp_layer(config, i))
    tensors["model.norm.weight"] = ("BF16", (hidden,))
    tensors["lm_head.weight"] = ("BF16", (vocab, hidden))
    return tensors


def _fp8(config: dict) -> bool:
    return config.get("quantization_config", {}).get("quant_method") == "fp8"


def _proj(config: dict, name: str, out_features: int, in_features: int) -> Tensors:
    """A linear weight: FP8 followed by its block scale in FP8 releases, else BF16."""
    if not _fp8(config):
        return {name: ("BF16", (out_features, in_features))}
    scale = (math.ceil(out_features / BLOCK), math.ceil(in_features / BLOCK))
    return {name: ("F8_E4M3", (out_features, in_features)), f"{name}_scale_inv": ("F32", scale)}


def _norm(name: str, width: int) -> Tensors:
    return {name: ("BF16", (width,))}


def _layer(config: dict, i: int) -> Tensors:
    """One decoder layer: norms, MLA attention, then a dense or MoE MLP."""
    p = f"model.layers.{i}."
    hidden = config["hidden_size"]
    tensors = _norm(p + "input_layernorm.weight", hidden)
    tensors.update(_attention(config, p + "self_attn."))
    tensors.update(_norm(p + "post_attention_layernorm.weight", hidden))
    if i < config["first_k_dense_replace"]:
        tensors.update(_mlp(config, p + "mlp.", config["intermediate_size"]))
    else:
        tensors.update(_moe(config, p + "mlp."))
    return tensors


def _attention(config: dict, p: str) -> Tensors:
    """Multi-head latent attention (low-rank query when q_lora_rank is set)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    tensors: Tensors = {}
    if q_rank is None:
        tensors.update(_proj(config, p + "q_proj.weight", heads * (nope + rope), hidden))
    else:
        tensors.update(_proj(config, p + "q_a_proj.weight", q_rank, hidden))
        tensors.update(_norm(p + "q_a_layernorm.weight", q_rank))
        tensors.update(_proj(config, p + "q_b_proj.weight", heads * (nope + rope), q_rank))
    tensors.update(_proj(config, p + "kv_a_proj_with_mqa.weight", kv_rank + rope, hidden))
    tensors.update(_norm(p + "kv_a_layernorm.weight", kv_rank))
    tensors.update(_proj(config, p + "kv_b_proj.weight", heads * (nope + v), kv_rank))
    tensors.update(_proj(config, p + "o_proj.weight", hidden, heads * v))
    return tensors


def _mlp(config: dict, p: str, width: int) -> Tensors:
    """A SwiGLU MLP of the given intermediate width."""
    hidden = config["hidden_size"]
    tensors = _proj(config, p + "gate_proj.weight", width, hidden)
    tensors.update(_proj(config, p + "up_proj.weight", width, hidden))
    tensors.update(_proj(config, p + "down_proj.weight", hidden, width))
    return tensors


def _moe(config: dict, p: str) -> Tensors:
    """Router (+ bias for noaux_tc), fused shared experts, then the routed experts."""
    experts, width = config["n_routed_experts"], config["moe_intermediate_size"]
    tensors: Tensors = {p + "gate.weight": ("BF16", (experts, config["hidden_size"]))}
    if config["topk_method"] == "noaux_tc":
        tensors[p + "gate.e_score_correction_bias"] = ("F32", (experts,))
    tensors.update(_mlp(config, p + "shared_experts.", width * config["n_shared_experts"]))
    for j in range(experts):
        tensors.update(_mlp(config, f"{p}experts.{j}.", width))
    return tensors


def _mtp_layer(config: dict, i: int) -> Tensors:
    """A multi-token-prediction module: its own embedding, projections, layer and head."""
    p = f"model.layers.{i}."
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    tensors = _norm(p + "enorm.weight", hidden)
    tensors.update(_norm(p + "hnorm.weight", hidden))
    tensors[p + "eh_proj.weight"] = ("BF16", (hidden, 2 * hidden))
    tensors[p + "embed_tokens.weight"] = ("BF16", (vocab, hidden))
    tensors.update(_layer(config, i))
    tensors.update(_norm(p + "shared_head.norm.weight", hidden))
    tensors[p + "shared_head.head.weight"] = ("BF16", (vocab, hidden))
    return tensors


def _structure(structure: str) -> tuple[dict, int]:
    if structure not in STRUCTURES:
        raise ValueError(f"unknown structure {structure!r}; known: {sorted(STRUCTURES)}")
    return STRUCTURES[structure]


# --------------------------------------------------------------------------- writing


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def shard_name(i: int, n: int) -> str:
    """The release's shard naming (1-based i; the total is 6 digits wide)."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def pack(sizes: list[int], files: int) -> list[int]:
    """Start index of each file when ``sizes`` are packed greedily, in order, into ``files``.

    The byte cap starts at ceil(total / files) and is raised (binary search) to the smallest
    cap for which greedy packing needs no more than ``files`` files. A tensor never splits.
    """
    if not 1 <= files <= len(sizes):
        raise ValueError(f"cannot pack {len(sizes)} tensors into {files} files")
    prefix = list(itertools.accumulate(sizes, initial=0))
    lo, hi = math.ceil(prefix[-1] / files), prefix[-1]
    while lo < hi:
        cap = (lo + hi) // 2
        if len(_greedy(prefix, cap)) <= files:
            hi = cap
        else:
            lo = cap + 1
    starts = _greedy(prefix, lo)
    if len(starts) != files:
        raise ValueError(f"greedy packing gives {len(starts)} files, not {files}")
    return starts


def _greedy(prefix: list[int], cap: int) -> list[int]:
    """Greedy file starts: fill each file up to ``cap`` bytes (an oversize tensor goes alone)."""
    starts, i, count = [], 0, len(prefix) - 1
    while i < count:
        starts.append(i)
        end = bisect.bisect_right(prefix, prefix[i] + cap) - 1  # last j with bytes(i:j) <= cap
        i = max(end, i + 1)
    return starts


def encode_header(tensors: Tensors, metadata: dict | None = None) -> tuple[bytes, int]:
    """Length prefix + space-padded JSON header for tensors packed in order, and the data size."""
    header: dict = {"__metadata__": metadata if metadata is not None else {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes(dtype, shape)
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def write_sparse_safetensors(path: Path, tensors: Tensors, metadata: dict | None = None) -> int:
    """Write a valid safetensors file whose data region is a hole; returns its data bytes."""
    head, data = encode_header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + data)
    return data


def write_release(folder: Path, structure: str, layers: int | None = None) -> Replica:
    """Write a sparse replica of ``structure``'s release into ``folder``.

    ``layers`` keeps only the first ``layers`` decoder layers (plus the MTP layer, renumbered
    as layer ``layers``) at full width, in shards of about ``CUT_SHARD_BYTES`` or less: a
    cheap structure for tests that damage or scan a whole folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = release_config(structure, layers)
    tensors = tensors_for_config(config)
    names = list(tensors)
    sizes = [nbytes(*tensors[name]) for name in names]
    files = _structure(structure)[1] if layers is None else math.ceil(sum(sizes) / CUT_SHARD_BYTES)
    starts = pack(sizes, files) + [len(names)]
    weight_map: dict[str, str] = {}
    data_bytes = 0
    for k in range(files):
        file_name = shard_name(k + 1, files)
        shard = {name: tensors[name] for name in names[starts[k] : starts[k + 1]]}
        data_bytes += write_sparse_safetensors(folder / file_name, shard)
        weight_map.update(dict.fromkeys(shard, file_name))

    _write_json(
        folder / INDEX_NAME, {"metadata": {"total_size": data_bytes}, "weight_map": weight_map}
    )
    _write_json(folder / "config.json", config)
    params = sum(math.prod(shape) for _, shape in tensors.values())
    return Replica(folder, files, len(tensors), params, data_bytes, config)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def sparse_files_supported(folder: Path) -> bool:
    """Whether ``folder``'s filesystem keeps a 1 GiB truncated file as a hole."""
    probe = Path(folder) / ".sparse-probe"
    try:
        with open(probe, "wb") as f:
            f.truncate(1 << 30)
        return os.stat(probe).st_blocks * 512 < (1 << 20)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


# --------------------------------------------------------------------------- corruption


def read_header(path: Path) -> dict:
    """The parsed JSON header of a safetensors file (``__metadata__`` included)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def read_index(folder: Path) -> dict:
    return json.loads((Path(folder) / INDEX_NAME).read_text())


def rewrite_header(path: Path, tensors: Tensors) -> None:
    """Rewrite ``path`` for a changed tensor list: new header, offsets repacked, new size."""
    metadata = read_header(path).get("__metadata__")
    write_sparse_safetensors(path, tensors, metadata)


def header_tensors(path: Path) -> Tensors:
    """A file's tensors as (dtype, shape), in data-offset order."""
    header = read_header(path)
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in entries}


def corrupt(folder: Path, kind: str) -> str:
    """Damage a written replica in one way (``CORRUPTIONS``); returns what was done."""
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; known: {sorted(CORRUPTIONS)}")
    folder = Path(folder)
    files = sorted(set(read_index(folder)["weight_map"].values()))
    return CORRUPTIONS[kind](folder, files)


def _truncated(folder: Path, files: list[str]) -> str:
    path = folder / files[-1]
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return f"truncated {files[-1]} from {size} to {size // 2} bytes"


def _header_length(folder: Path, files: list[str]) -> str:
    path = folder / files[0]
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", size))  # 8 + size > size: the header runs past the end
    return f"{files[0]}'s length prefix claims a {size}-byte header in a {size}-byte file"


def _missing_shard(folder: Path, files: list[str]) -> str:
    victim = files[len(files) // 2]
    (folder / victim).unlink()
    return f"deleted {victim}, which the index names"


def _wrong_file(folder: Path, files: list[str]) -> str:
    if len(files) < 2:
        raise ValueError("wrong_file needs a replica of at least two files")
    index = read_index(folder)
    name = next(iter(header_tensors(folder / files[-1])))
    index["weight_map"][name] = files[0]
    _write_json(folder / INDEX_NAME, index)
    return f"index points {name} at {files[0]}; its header is in {files[-1]}"


def _scale_shape(folder: Path, files: list[str]) -> str:
    for file_name in files:
        tensors = header_tensors(folder / file_name)
        name = next((n for n in tensors if n.endswith("weight_scale_inv")), None)
        if name is not None:
            break
    else:
        raise ValueError("scale_shape needs an FP8 (deepseek-v3) replica")
    dtype, (rows, cols) = tensors[name]
    tensors[name] = (dtype, (rows - 1, cols))
    rewrite_header(folder / file_name, tensors)
    index = read_index(folder)
    index["metadata"]["total_size"] -= nbytes(dtype, (1, cols))
    _write_json(folder / INDEX_NAME, index)
    return f"{name} in {file_name} reshaped from [{rows}, {cols}] to [{rows - 1}, {cols}]"


def _unknown_dtype(folder: Path, files: list[str]) -> str:
    path = folder / files[0]
    tensors = header_tensors(path)
    name = next(n for n, (dtype, _) in tensors.items() if dtype == "BF16")
    tensors[name] = ("I16", tensors[name][1])  # same itemsize: offsets and size unchanged
    rewrite_header(path, tensors)
    return f"{name} in {files[0]} relabelled from BF16 to I16"


CORRUPTIONS = {
    "truncated": _truncated,
    "header_length": _header_length,
    "missing_shard": _missing_shard,
    "wrong_file": _wrong_file,
    "scale_shape": _scale_shape,
    "unknown_dtype": _unknown_dtype,
}
"""kind -> function(folder, sorted shard names) -> description."""
