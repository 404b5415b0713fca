"""A Hugging Face DeepSeek-V2/V3 checkpoint (`config.json`, safetensors, their index) as a run's
initial weights, read straight into whatever part of each tensor this process holds.

Why our own reader rather than DCP's `HuggingFaceStorageReader`: the part a rank holds is
already described, for every layout, by the `LocalBox` the initialiser fills (TP, EP, FSDP2 and
their 2-D compositions; `dstrain/parallel/materialize.py`), so loading is the initialiser with
another source: each box is read with safetensors' sliced reads (`get_slice`), only the rows and
columns the box covers. The routed experts, stacked [E, ...] here and one tensor per expert in
the checkpoint (`mlp.experts.{j}.gate_proj.weight`), are read expert by expert for the experts
of the box, never gathered; transformers' fused layout (`mlp.experts.gate_up_proj`) is read too.
DCP's quantized reader wants each FP8 tensor and its scales in one file and a state dict of
per-expert DTensor views; this one reads a box's FP8 rows and the scale blocks they touch.

FP8 (DeepSeek-V3's release): an `X.weight` in e4m3 with `X.weight_scale_inv`, one fp32 scale per
128 x 128 block (the last blocks of a row or column may be partial: the scale grid is
ceil(rows/128) x ceil(cols/128)); dequantised as w = q x scale_inv of its block, in fp32.

The folder is known from its headers (`hf_files.py`) and judged before anything is read
(`hf_verify.py`): a missing, extra, mis-shaped or wrongly typed tensor, a bad block scale or a
damaged file is one error naming each; nothing is dropped. The MTP layers' copies of the
embedding and the head are compared with the main tensors on each rank's box (`_compare_copy`).
`HFCheckpoint(read_data=False)` runs the same loader as a plan: the bytes and files each rank's
load reads, for the pre-launch check.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError
from dstrain.model.hf_adapter import mtp_copies, to_hf
from dstrain.model.hf_files import FP8, INDEX, Headers, TensorEntry, read_headers
from dstrain.model.hf_verify import (
    SCALE_SUFFIX,
    block_size,
    fix_for,
    summary,
    verify,
)
from dstrain.model.init import LocalBox, canonical_name, reset_buffers, whole


@dataclass
class Loaded:
    """What a load filled: tensors, of which FP8-dequantised."""

    tensors: int = 0
    fp8: int = 0


class HFCheckpoint:
    """The tensors of a checkpoint folder, known from its headers (`hf_files.read_headers`),
    read slice by slice. `read_data=False` plans instead: `read` returns an empty tensor of the
    slice's shape on `meta` and counts the bytes and files a load would read (the pre-launch
    check's per-rank reads). `headers`: the folder's, where the caller read them already."""

    def __init__(
        self, folder: Path, *, read_data: bool = True, headers: Headers | None = None
    ) -> None:
        if not any(folder.glob("*.safetensors")) and not (folder / INDEX).exists():
            raise UserError(
                f"model.init_from: no .safetensors files in {folder}",
                "point model.init_from at a Hugging Face checkpoint folder (config.json and "
                "model*.safetensors)",
                exit_code=1,
            )
        self.folder = folder
        self.read_data = read_data
        self.headers: Headers = headers if headers is not None else read_headers(folder)
        self.tensors: dict[str, TensorEntry] = self.headers.tensors
        self.block, _ = block_size(self.headers.config)
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0  # what this process read (or would): its slices, not the checkpoint
        self.files_read: set[Path] = set()
        self.total_bytes = self.headers.data_bytes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The `index` part of tensor `name`, dequantised to fp32 when it is FP8."""
        entry = self.tensors[name]
        part = self._slice(name, index)
        if entry.dtype == FP8:
            return self._dequantised(name, part, index, entry.shape)
        return part

    def _slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        entry = self.tensors[name]
        self.files_read.add(entry.file)
        shape = [len(range(*s.indices(n))) for s, n in zip(index, entry.shape, strict=False)]
        shape += list(entry.shape[len(index) :])
        itemsize = entry.nbytes // max(1, _numel(entry.shape))
        self.bytes_read += _numel(tuple(shape)) * itemsize
        if not self.read_data:
            return torch.empty(shape, device="meta")
        return self._handle(entry.file).get_slice(name)[index]

    def _dequantised(
        self, name: str, q: torch.Tensor, index: tuple[slice, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        b = self.block
        bounds = zip(index, shape, strict=True)
        (r0, r1), (c0, c1) = ((s.start or 0, n if s.stop is None else s.stop) for s, n in bounds)
        blocks = (slice(r0 // b, -(-r1 // b)), slice(c0 // b, -(-c1 // b)))
        scale = self._slice(name + SCALE_SUFFIX, blocks).float()
        if not self.read_data:
            return q
        grid = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)
        rows, cols = r0 - (r0 // b) * b, c0 - (c0 // b) * b
        return q.float() * grid[rows : rows + q.size(0), cols : cols + q.size(1)]

    def _handle(self, file: Path):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt").__enter__()
        return self._handles[file]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def check(checkpoint: HFCheckpoint, args: ModelArgs) -> None:
    """Every tensor the architecture needs is there with its shape and a dtype the loader reads,
    and nothing else is; else one message naming every problem."""
    found = verify(checkpoint.headers, args)
    if found:
        raise UserError(
            f"model.init_from: {checkpoint.folder} does not fit this model:\n  {summary(found)}",
            fix_for(found, args),
            exit_code=1,
        )


@torch.no_grad()
def load_parameters(
    model: nn.Module,
    checkpoint: HFCheckpoint,
    local_box: Callable[[torch.Tensor], LocalBox] = whole,
) -> Loaded:
    """Fill every parameter and the balancing biases of `model` (after `to_empty`) with its
    part of the checkpoint's tensors; the other buffers are reset as the initialiser does."""

    args: ModelArgs = model.args
    loaded = Loaded()
    copies: dict[str, list[str]] = {}
    for copy, main in mtp_copies(args).items():
        copies.setdefault(main, []).append(copy)
    reset_buffers(model)  # RoPE tables, load counters; balancing biases zero (DeepSeek-V2)
    for name, tensor in [*model.named_parameters(), *expert_biases(model)]:
        key = canonical_name(name)
        box = local_box(tensor)
        hf = list(to_hf({key: torch.empty(box.global_shape, device="meta")}, args))
        if not hf:
            raise UserError(f"model.init_from: no checkpoint tensor for {key}", "", exit_code=1)
        if key.endswith("expert_bias") and hf[0] not in checkpoint.tensors:
            continue  # a DeepSeek-V2 checkpoint: no balancing bias, it starts at zero
        _load_box(checkpoint, box, hf, loaded)
        for copy in copies.get(hf[0], ()):
            _compare_copy(checkpoint, box, hf[0], copy)
    return loaded


def _compare_copy(checkpoint: HFCheckpoint, box: LocalBox, main: str, copy: str) -> None:
    """The MTP layer's copy of the embedding or head equals the main tensor on this rank's box
    (`hf_verify`'s docstring: dstrain's MTP shares them, as DeepSeek's does)."""
    if copy not in checkpoint.tensors or box.local.numel() == 0:
        return
    index = tuple(slice(o, o + n) for o, n in zip(box.offset, box.local.shape, strict=True))
    ours, theirs = checkpoint.read(main, index), checkpoint.read(copy, index)
    if checkpoint.read_data and not torch.equal(ours, theirs):
        rows = (ours != theirs).flatten(1).any(1).nonzero().flatten()
        raise UserError(
            f"model.init_from: {copy} differs from {main} ({rows.numel()} of the "
            f"{ours.size(0)} rows read here, first row {int(rows[0]) + index[0].start}): this "
            "checkpoint's MTP layer has its own embedding or head, and dstrain's MTP shares the "
            "main model's (as DeepSeek-V3's does)",
            f"copy {main} over {copy} in the checkpoint, or drop the MTP layer "
            "(--set model.num_mtp_modules=0)",
            exit_code=1,
        )


def expert_biases(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The MoE balancing biases: buffers, yet checkpoint tensors."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")]


def _load_box(checkpoint: HFCheckpoint, box: LocalBox, names: list[str], loaded: Loaded) -> None:
    local, offset = box.local, box.offset
    if local.numel() == 0:
        return
    if len(names) == 1:  # one checkpoint tensor for the whole global tensor
        index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
        _copy(checkpoint, names[0], index, local, loaded)
        return
    # Stacked experts: one checkpoint tensor per expert, the box's experts only.
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    for row in range(local.shape[0]):
        _copy(checkpoint, names[offset[0] + row], rest, local[row], loaded)


def _copy(
    checkpoint: HFCheckpoint,
    name: str,
    index: tuple[slice, ...],
    out: torch.Tensor,
    loaded: Loaded,
) -> None:
    if name in checkpoint.tensors:
        values = checkpoint.read(name, index)
    else:  # transformers' fused experts: gate_up_proj [E, 2F, D], down_proj [E, D, F]
        values = _read_fused(checkpoint, name, index)
    loaded.tensors += 1
    entry = checkpoint.tensors.get(name)
    loaded.fp8 += entry is not None and entry.dtype == FP8
    out.copy_(values.reshape(out.shape))


def _read_fused(checkpoint: HFCheckpoint, name: str, index: tuple[slice, ...]) -> torch.Tensor:
    match = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
    if match is None:
        raise UserError(f"model.init_from: the checkpoint has no {name}", "", exit_code=1)
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    if kind == "down_proj":
        return checkpoint.read(f"{prefix}.down_proj", (slice(expert, expert + 1), *index))[0]
    fused = f"{prefix}.gate_up_proj"
    width = checkpoint.shape(fused)[1] // 2
    rows, cols = index
    start = (rows.start or 0) + (width if kind == "up_proj" else 0)
    stop = (rows.stop if rows.stop is not None else width) + (width if kind == "up_proj" else 0)
    return checkpoint.read(fused, (slice(expert, expert + 1), slice(start, stop), cols))[0]
