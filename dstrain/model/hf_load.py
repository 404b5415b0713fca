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

Every tensor is accounted for, against the names the architecture implies (`expected`): a
missing, extra or mis-shaped tensor is an error naming it and the fix; nothing is dropped.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError
from dstrain.model.hf_adapter import to_hf
from dstrain.model.init import LocalBox, canonical_name, reset_buffers, whole

SCALE_SUFFIX = "_scale_inv"
IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)  # buffers some exports carry; recomputed here
MAX_LISTED = 5


@dataclass
class Loaded:
    """What a load filled: tensors, of which FP8-dequantised."""

    tensors: int = 0
    fp8: int = 0


class HFCheckpoint:
    """The tensors of a checkpoint folder: name -> (file, shape, dtype), from the safetensors
    headers (the index file names the files; without one, every *.safetensors is read)."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UserError(
                f"model.init_from: no .safetensors files in {folder}",
                "point model.init_from at a Hugging Face checkpoint folder (config.json and "
                "model*.safetensors)",
                exit_code=1,
            )
        self.block = _block_size(folder)
        self._open = safe_open
        self.tensors: dict[str, tuple[Path, tuple[int, ...], str]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    part = handle.get_slice(name)
                    self.tensors[name] = (file, tuple(part.get_shape()), part.get_dtype())
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0  # what this process read: its slices, not the checkpoint
        self.total_bytes = sum(
            _numel(shape) * _DTYPE_BYTES.get(dtype, 4) for _, shape, dtype in self.tensors.values()
        )

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The `index` part of tensor `name`, dequantised to fp32 when it is FP8."""
        file, shape, dtype = self.tensors[name]
        part = self._handle(file).get_slice(name)[index]
        self.bytes_read += part.numel() * part.element_size()
        if dtype.startswith("F8"):
            return self._dequantised(name, part, index, shape)
        return part

    def _dequantised(
        self, name: str, q: torch.Tensor, index: tuple[slice, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.tensors:
            raise UserError(
                f"model.init_from: {name} is FP8 but the checkpoint has no {scale_name}",
                "use a complete FP8 checkpoint (each e4m3 weight with its block scales)",
                exit_code=1,
            )
        b = self.block
        bounds = zip(index, shape, strict=True)
        (r0, r1), (c0, c1) = ((s.start or 0, n if s.stop is None else s.stop) for s, n in bounds)
        blocks = (slice(r0 // b, -(-r1 // b)), slice(c0 // b, -(-c1 // b)))
        file = self.tensors[scale_name][0]
        scale = self._handle(file).get_slice(scale_name)[blocks].float()
        grid = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)
        rows, cols = r0 - (r0 // b) * b, c0 - (c0 // b) * b
        return q.float() * grid[rows : rows + q.size(0), cols : cols + q.size(1)]

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._open(str(file), framework="pt").__enter__()
        return self._handles[file]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _block_size(folder: Path) -> int:
    """The FP8 block edge of `quantization_config.weight_block_size` (DeepSeek-V3: 128)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 128
    block = (config.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    if len(set(block)) != 1:
        raise UserError(
            f"model.init_from: weight_block_size {block} is not square",
            "dstrain reads DeepSeek-V3's 128 x 128 blocks (any square block)",
            exit_code=1,
        )
    return int(block[0])


def expected(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes that `args` implies (per-expert layout). The
    balancing bias only with sigmoid routing: DeepSeek-V2 (softmax) checkpoints have none."""
    from dstrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    state = {k: v for k, v in model.state_dict().items() if "tokens_per_expert" not in k}
    if args.score_func != "sigmoid":
        state = {k: v for k, v in state.items() if not k.endswith("expert_bias")}
    return {name: tuple(t.shape) for name, t in to_hf(state, args).items()}


def check(checkpoint: HFCheckpoint, args: ModelArgs) -> None:
    """Every tensor the architecture needs is there with its shape, and nothing else is (the
    fused expert layout counts for the per-expert one)."""
    wanted = expected(args)
    present = set(checkpoint.tensors)
    fused = _fused_names(present)
    missing = [n for n in wanted if n not in present and _fused_source(n) not in fused]
    used = set(wanted) | {n + SCALE_SUFFIX for n in wanted} | fused
    extra = [n for n in present if n not in used and not any(p.match(n) for p in IGNORED)]
    if missing:
        raise UserError(
            f"model.init_from: {checkpoint.folder} lacks {len(missing)} tensor(s) this "
            f"architecture needs: {_listed(missing)}",
            _fix_for_missing(missing, args),
            exit_code=1,
        )
    if extra:
        raise UserError(
            f"model.init_from: {checkpoint.folder} holds {len(extra)} tensor(s) this "
            f"architecture has no place for: {_listed(extra)}",
            "set the model to the checkpoint's architecture (model.hf_config = its config.json, "
            "no overrides of layer, expert or MTP counts); nothing is dropped silently",
            exit_code=1,
        )
    for name, shape in wanted.items():
        if name in present and checkpoint.shape(name) != shape:
            raise UserError(
                f"model.init_from: {name} is {list(checkpoint.shape(name))} in the checkpoint, "
                f"{list(shape)} in this architecture",
                "use the checkpoint's own config.json for the model (drop the overrides that "
                "change this tensor's shape)",
                exit_code=1,
            )


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def _fix_for_missing(missing: list[str], args: ModelArgs) -> str:
    mtp_layer = f"model.layers.{args.num_layers}."
    if args.num_mtp_modules and all(n.startswith(mtp_layer) for n in missing):
        return (
            "the checkpoint has no multi-token-prediction layer (transformers drops it on save): "
            "--set model.num_mtp_modules=0"
        )
    return "point model.init_from at a checkpoint of this architecture, or fix the overrides"


_FUSED = re.compile(r"(.*\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.weight")


def _fused_source(name: str) -> str | None:
    match = _FUSED.fullmatch(name)
    if match is None:
        return None
    prefix, kind = match.groups()
    return f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"


def _fused_names(present: set[str]) -> set[str]:
    return {n for n in present if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}


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
    reset_buffers(model)  # RoPE tables, load counters; balancing biases zero (DeepSeek-V2)
    for name, tensor in [*model.named_parameters(), *_biases(model)]:
        key = canonical_name(name)
        box = local_box(tensor)
        hf = list(to_hf({key: torch.empty(box.global_shape, device="meta")}, args))
        if not hf:
            raise UserError(f"model.init_from: no checkpoint tensor for {key}", "", exit_code=1)
        if key.endswith("expert_bias") and hf[0] not in checkpoint.tensors:
            continue  # a DeepSeek-V2 checkpoint: no balancing bias, it starts at zero
        _load_box(checkpoint, box, hf, loaded)
    return loaded


def _biases(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
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
    loaded.fp8 += checkpoint.tensors.get(name, ("", (), ""))[2].startswith("F8")
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
