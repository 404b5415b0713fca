"""Export a run's checkpoint as a Hugging Face model folder: several safetensors files with
`model.safetensors.index.json` and a `config.json` that `transformers` loads (its `torch_dtype`
set), in the dtype asked for (bf16 by default, as HF ships). `fp8` writes DeepSeek-V3's release
format: every projection weight (`*_proj*.weight` of attention, dense MLP, shared and routed
experts) in E4M3 with `weight_scale_inv`, one fp32 scale per 128 x 128 block (amax / 448), the
rest (embedding, head, norms, router, `eh_proj`) in bf16, `quantization_config` in config.json.

Streamed: the checkpoint's tensors are read from DCP a file's worth at a time (`dcp.load` of just
those keys), converted, split per expert and written, so the host holds about one output file,
never the whole model. Round trip: `model.init_from` of the export gives the checkpoint's weights
back, bit for bit in fp32 (and their bf16 rounding in bf16). As DeepSeek's release does, each MTP
layer also holds copies of the embedding and the head (`embed_tokens`, `shared_head.head`), which
vLLM's and SGLang's MTP loaders read.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dstrain.checkpoint import manifest, store
from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import load_config
from dstrain.config.model_args import ModelArgs
from dstrain.config.validate import raise_if_errors
from dstrain.errors import UserError
from dstrain.model.fp8 import quantize_blocks
from dstrain.model.hf_adapter import check_exportable, hf_config, to_hf, with_mtp_copies
from dstrain.model.hf_verify import SCALE_SUFFIX

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,  # the projections; the rest bf16 (module docstring)
}
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}
FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
INDEX = "model.safetensors.index.json"
SKIPPED = ("tokens_per_expert", "last_aux_loss")  # buffers that are not weights


@dataclass
class Exported:
    checkpoint: Path
    output: Path
    files: int
    tensors: int
    bytes: int
    dtype: str


def export_hf(
    source: Path,
    out_dir: Path,
    *,
    dtype: str = "bf16",
    shard_bytes: int = 2 * 2**30,
    progress: Callable[[int, int], None] | None = None,
) -> Exported:
    """`source`: a run directory (its newest valid checkpoint: full, else model-only) or a step-N
    folder. `progress(done, total)` is called after each tensor."""
    run_dir, ckpt = _locate(source)
    loaded = load_config(run_dir / "config.toml")
    raise_if_errors(loaded.findings)
    args = resolve_model_args(loaded.config.model)
    check_exportable(args)
    _check_output(out_dir)
    tensors = _model_tensors(ckpt)
    files = list(_plan(tensors, DTYPES[dtype].itemsize, shard_bytes))
    weight_map, total, done = {}, 0, 0
    for number, names in enumerate(files, start=1):
        file = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        written = _write_file(ckpt, names, tensors, args, DTYPES[dtype], out_dir / file)
        for name, nbytes in written.items():
            weight_map[name] = file
            total += nbytes
        done += len(names)
        if progress is not None:
            progress(done, len(tensors))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config(args) | {"torch_dtype": TORCH_DTYPE[dtype]}
    if dtype == "fp8":
        config["quantization_config"] = FP8_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Exported(ckpt, out_dir, len(files), len(weight_map), total, dtype)


def _model_tensors(ckpt: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Our weight names in the checkpoint, with their global shapes and dtypes (DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as exc:  # unreadable .metadata: a damaged checkpoint
        raise UserError(
            f"{ckpt} cannot be read ({type(exc).__name__}: {exc})",
            "export another checkpoint (`dstrain ckpt inspect RUN_DIR` lists them)",
            exit_code=1,
        ) from None
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith("model.") or not isinstance(meta, TensorStorageMetadata):
            continue
        name = key.removeprefix("model.")
        if not name.endswith(SKIPPED):
            out[name] = (tuple(meta.size), meta.properties.dtype)
    return out


def _plan(
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], itemsize: int, shard_bytes: int
) -> Iterator[list[str]]:
    """Our tensors grouped into output files of about `shard_bytes` (a tensor never splits)."""
    group, size = [], 0
    for name, (shape, _) in tensors.items():
        nbytes = itemsize * _numel(shape)
        if group and size + nbytes > shard_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _write_file(
    ckpt: Path,
    names: list[str],
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
    args: ModelArgs,
    dtype: torch.dtype,
    path: Path,
) -> dict[str, int]:
    """Read `names` from the checkpoint, write them (HF names, `dtype`) to `path`; returns each
    written tensor's bytes. Holds this file's tensors only."""
    from safetensors.torch import save_file

    state = {"model": {n: torch.empty(tensors[n][0], dtype=tensors[n][1]) for n in names}}
    store.load(ckpt, state)
    out = {}
    for name in names:
        value = state["model"].pop(name)
        for hf_name, tensor in with_mtp_copies(to_hf({name: value}, args), args).items():
            out.update(_stored(hf_name, tensor, dtype))
    tmp = path.with_suffix(".tmp")
    save_file(out, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return {name: t.numel() * t.element_size() for name, t in out.items()}


def _stored(name: str, value: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One HF tensor as the release stores it in `dtype`: balancing biases stay fp32 (as
    DeepSeek's release keeps them); in FP8, projections become E4M3 and their block scales."""
    if name.endswith("e_score_correction_bias"):
        return {name: value}
    if dtype != torch.float8_e4m3fn:
        return {name: value.to(dtype)}
    if not is_fp8_projection(name):
        return {name: value.to(torch.bfloat16)}
    q = quantize_blocks(value.float())
    data = q.data[:, : q.cols].contiguous()  # the K padding to whole blocks is not stored
    return {name: data, name + SCALE_SUFFIX: q.scale.contiguous()}


def is_fp8_projection(name: str) -> bool:
    """The tensors DeepSeek-V3's release stores in E4M3: every projection (`q_a_proj`, ...,
    `kv_a_proj_with_mqa`, `gate_proj`, ...) but the MTP's `eh_proj`."""
    if not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return "_proj" in module and module != "eh_proj"


def _check_output(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"-o {out_dir} is a file", "give a folder to write the export into", 1)
    if out_dir.is_dir() and any(
        p.suffix == ".safetensors" or p.name == INDEX for p in out_dir.iterdir()
    ):
        raise UserError(
            f"-o {out_dir} already holds a Hugging Face model",
            "give an empty or new folder (an export never overwrites one)",
            exit_code=1,
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".dstrain-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"-o {out_dir} cannot be written ({exc.strerror or exc})",
            "give a folder you can write to",
            exit_code=1,
        ) from None


def _locate(source: Path) -> tuple[Path, Path]:
    if (source / ".metadata").exists() or (source / manifest.MANIFEST).exists():
        run_dir = next((p for p in source.parents if (p / "config.toml").exists()), None)
        if run_dir is None:
            raise UserError(
                f"{source} is a checkpoint outside a run directory (no config.toml above it)",
                "pass it inside its runs/<name> folder, which holds the model's config.toml",
                exit_code=1,
            )
        verdict = manifest.verify(source, quick=None)
        if not verdict.ok:
            raise UserError(
                f"{source} is not a valid checkpoint: {verdict.reason}",
                "export another one (`dstrain ckpt inspect RUN_DIR` lists them and why)",
                exit_code=1,
            )
        return run_dir, source
    if not (source / "config.toml").exists():
        raise UserError(
            f"{source} is neither a run directory nor a checkpoint",
            "pass runs/<name> or runs/<name>/checkpoints/step-N",
            exit_code=1,
        )
    folder = source / "checkpoints"
    ckpt = store.latest(folder) or store.latest_valid(folder, kind="model")
    if ckpt is None:
        raise UserError(f"{source} has no valid checkpoint yet", "train it first", exit_code=1)
    return source, ckpt
