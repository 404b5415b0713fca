"""What a Hugging Face DeepSeek checkpoint must hold for an architecture, and every way a folder
falls short: from the headers alone (`hf_files.read_headers`), reading no tensor data.

The structure is the release's (DeepSeek-V2/V2-Lite, V3, R1 and V3.1 share it):
- one tensor per expert (`mlp.experts.{j}.gate_proj.weight`); transformers' fused in-memory form
  (`mlp.experts.gate_up_proj`) counts for them too;
- MTP depth k as decoder layer `num_layers + k - 1`, with `enorm`, `hnorm`, `eh_proj`,
  `shared_head.norm`, and two more tensors: `embed_tokens.weight` and `shared_head.head.weight`.
  DeepSeek's README_WEIGHTS says the MTP module *shares* the embedding and the output head with
  the main model, and so does dstrain's MTP (one embedding, one head): the two are copies. They
  are optional (transformers' save drops the whole MTP layer; older exports lack them), must have
  the main tensors' shape where present, and at load each rank compares its slice of the copy
  with its slice of the main tensor (`hf_load`): a checkpoint whose MTP trained its own head
  would otherwise be loaded as something it is not.
- FP8 (V3's release): a 2-D weight stored as `F8_E4M3` comes with `<name>_scale_inv`, fp32,
  one scale per `block` x `block` tile: [ceil(rows/block), ceil(cols/block)]. Everything else is
  F32, BF16 or F16 (the release: bf16 embeddings, head, norms, router, `eh_proj`; fp32 balancing
  biases).
"""

from collections import defaultdict

from dstrain.config.model_args import ModelArgs
from dstrain.model.hf_adapter import mtp_copies
from dstrain.model.hf_files import FLOATS, FP8, Headers, Problem

SCALE_SUFFIX = "_scale_inv"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports carry; recomputed here
MAX_LISTED = 5


def expected(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes that `args` implies (per-expert layout, without
    the MTP copies: `mtp_copies`). The balancing bias only with sigmoid routing: DeepSeek-V2
    (softmax) checkpoints have none."""
    import torch

    from dstrain.model.hf_adapter import to_hf
    from dstrain.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    state = {k: v for k, v in model.state_dict().items() if "tokens_per_expert" not in k}
    if args.score_func != "sigmoid":
        state = {k: v for k, v in state.items() if not k.endswith("expert_bias")}
    return {name: tuple(t.shape) for name, t in to_hf(state, args).items()}


def scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    return tuple(-(-n // block) for n in shape)


def block_size(config: dict) -> tuple[int, Problem | None]:
    """The FP8 block edge of `quantization_config.weight_block_size` (V3: [128, 128])."""
    block = (config.get("quantization_config") or {}).get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
        detail = f"weight_block_size {block}: dstrain reads square FP8 blocks (V3: [128, 128])"
        return 128, Problem("scale", "config.json", detail)
    return int(block[0]), None


def verify(headers: Headers, args: ModelArgs) -> list[Problem]:
    """Every problem of the folder for `args`: its files' and index's own, then each tensor that
    is missing, extra, mis-shaped, of a dtype the loader does not read, or whose block scale is
    absent or mis-shaped."""
    problems = list(headers.problems)
    block, bad_block = block_size(headers.config)
    if bad_block is not None:
        problems.append(bad_block)
    wanted = expected(args)
    copies = mtp_copies(args)
    present = headers.tensors
    fused = {n for n in present if n.endswith(_FUSED_SUFFIXES)}
    for name in wanted:
        lost = headers.lost_with_file(name)  # said once, as its file's problem
        if name not in present and _fused_source(name) not in fused and not lost:
            problems.append(Problem("missing", name, "this architecture needs it"))
    scales = {n + SCALE_SUFFIX for n in (*wanted, *copies, *fused)}
    known = set(wanted) | set(copies) | fused
    for name, entry in present.items():
        if name in scales or name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in known:
            problems.append(Problem("extra", name, "this architecture has no place for it"))
            continue
        want = wanted.get(name) or wanted.get(copies.get(name, ""))
        if want is not None and entry.shape != want:
            problems.append(
                Problem("shape", name, f"{list(entry.shape)} here, {list(want)} in the model")
            )
        problems.extend(_dtype_problems(headers, name, block))
    for name in present:
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) not in present:
            problems.append(Problem("extra", name, "a block scale of no tensor"))
    return problems


def _dtype_problems(headers: Headers, name: str, block: int) -> list[Problem]:
    entry = headers.tensors[name]
    scale = headers.tensors.get(name + SCALE_SUFFIX)
    if entry.dtype in FLOATS:
        if scale is not None:
            return [Problem("scale", name, f"{entry.dtype} yet has a {name + SCALE_SUFFIX}")]
        return []
    if entry.dtype != FP8:
        return [Problem("dtype", name, f"{entry.dtype}: the loader reads F32, BF16, F16, F8_E4M3")]
    if len(entry.shape) != 2:
        return [Problem("dtype", name, f"F8_E4M3 on a {len(entry.shape)}-D tensor")]
    want = scale_shape(entry.shape, block)
    if scale is None:
        return [Problem("scale", name, f"F8_E4M3 without its {name + SCALE_SUFFIX}")]
    if scale.shape != want:
        return [
            Problem(
                "scale",
                name + SCALE_SUFFIX,
                f"{list(scale.shape)}; {list(entry.shape)} in {block} x {block} blocks needs "
                f"{list(want)}",
            )
        ]
    if scale.dtype not in FLOATS:
        return [Problem("dtype", name + SCALE_SUFFIX, f"{scale.dtype}: scales are F32")]
    return []


_FUSED_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _fused_source(name: str) -> str | None:
    """`...mlp.experts.{j}.up_proj.weight` -> the fused tensor holding it, if it is an expert's."""
    head, sep, rest = name.partition(".mlp.experts.")
    if not sep or not rest.endswith(".weight"):
        return None
    kind = rest.split(".")[1]
    return f"{head}.mlp.experts.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"


# ---- one message for them all ----------------------------------------------------------------

_KIND_TITLES = {
    "file": "damaged file(s)",
    "index": "index disagreement(s)",
    "missing": "missing tensor(s)",
    "extra": "extra tensor(s)",
    "shape": "mis-shaped tensor(s)",
    "dtype": "tensor(s) of a dtype the loader does not read",
    "scale": "FP8 block scale problem(s)",
}


def summary(problems: list[Problem]) -> str:
    """`N missing tensor(s): a, b, c and 4 more; ...`, every kind on its own line."""
    by_kind: dict[str, list[Problem]] = defaultdict(list)
    for problem in problems:
        by_kind[problem.kind].append(problem)
    lines = []
    for kind, title in _KIND_TITLES.items():
        found = by_kind.get(kind)
        if not found:
            continue
        shown = "; ".join(_said(p) for p in found[:MAX_LISTED])
        more = f" and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
        lines.append(f"{len(found)} {title}: {shown}{more}")
    return "\n  ".join(lines)


def _said(problem: Problem) -> str:
    """A missing or extra tensor by its name alone; the rest with what is wrong."""
    return problem.name if problem.kind in ("missing", "extra") else str(problem)


def fix_for(problems: list[Problem], args: ModelArgs) -> str:
    """The fix for the gravest kind present."""
    kinds = {p.kind for p in problems}
    if kinds & {"file", "index"}:
        return (
            "the folder is damaged or incomplete: download or copy it again (compare each "
            "file's size with the source's), then rerun `dstrain ckpt verify-hf`"
        )
    missing = [p.name for p in problems if p.kind == "missing"]
    mtp_layer = f"model.layers.{args.num_layers}."
    if missing and args.num_mtp_modules and all(n.startswith(mtp_layer) for n in missing):
        return (
            "the checkpoint has no multi-token-prediction layer (transformers drops it on save): "
            "--set model.num_mtp_modules=0, or use the release's own files"
        )
    if kinds & {"dtype", "scale"}:
        return (
            "store weights as F32, BF16 or F16, or as F8_E4M3 with fp32 block scales "
            "[ceil(rows/128), ceil(cols/128)] (DeepSeek-V3's format)"
        )
    return (
        "set the model to the checkpoint's architecture (leave model.flavor and model.hf_config "
        "unset so init_from's config.json decides, and no overrides of layer, expert or MTP "
        "counts); nothing is dropped silently"
    )
