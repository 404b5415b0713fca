"""Megatron-Core's own verdict on a launch script, when megatron-core is importable: its
`TransformerConfig` built from the script's flags (whose `__post_init__` asserts what Megatron
refuses in the model and layout), and its per-rank layer split (`get_num_layers_to_build`) on
every pipeline rank and virtual stage, set beside dstrain's reading of it (megatron_split.py).

Megatron-LM's argument parser and `validate_args` live in `megatron.training`, which the
megatron-core package does not ship; the virtual size they derive from
--num-layers-per-virtual-pipeline-stage is taken from megatron_split here.
"""

import contextlib
import io
import os
import warnings
from importlib.util import find_spec
from typing import Any

from dstrain.config.findings import Finding, error, info, warning
from dstrain.interop import megatron_split

ENGINE_ENV = "DSTRAIN_MEGATRON_ENGINE"  # "0": judge by the offline rules alone
ENGINE_KEY = "megatron-core engine"
ENGINES = ("Megatron-LM", "ms-swift")  # the launchers that build Megatron-Core's config
# Flags whose argparse dest differs from the TransformerConfig field; every other flag named as
# a field is passed under its own name, as Megatron-LM's core_transformer_config_from_args does.
_RENAMED = {
    "num_experts": "num_moe_experts",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}
_STORE_FALSE = {"disable_bias_linear": "add_bias_linear"}  # --disable-bias-linear and the like


def engine_verdict(engine: str, flags: dict[str, Any]) -> list[Finding]:
    """Megatron-Core's verdict on a Megatron-LM (or ms-swift) script's flags: [] without
    megatron-core, with DSTRAIN_MEGATRON_ENGINE=0, for other engines, or without --num-layers."""
    if (
        engine not in ENGINES
        or os.environ.get(ENGINE_ENV, "1") == "0"
        or find_spec("megatron") is None
        or find_spec("megatron.core") is None
    ):
        return []
    layers = flags.get("num_layers")
    if not _whole(layers):
        return []
    pp = flags.get("pipeline_model_parallel_size", 1)
    pp = pp if _whole(pp) else 1
    vp, refused = megatron_split._virtual_size(layers, pp, flags)
    if refused:
        return []  # megatron_split reports validate_args' refusal already
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with quiet[0], quiet[1], warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import megatron.core
            from megatron.core.transformer.transformer_block import get_num_layers_to_build
            from megatron.core.transformer.transformer_config import TransformerConfig
        except Exception as exc:  # a broken install must not stop check
            return [info(ENGINE_KEY, f"megatron-core is installed but does not import: {exc}")]
        kwargs, placeholders = _config_kwargs(flags)
        if vp > 1:
            kwargs["virtual_pipeline_model_parallel_size"] = vp
        where = f"Megatron-Core {megatron.core.__version__}'s TransformerConfig"
        if placeholders:
            where += f" (the script gives no {', '.join(placeholders)}: stand-ins divisible by "
            where += "every parallel size)"
        try:
            config = TransformerConfig(**kwargs, **_dtypes(flags))
            # Schedule order: stage s is model chunk s // pp of pipeline rank s % pp.
            stages = [
                get_num_layers_to_build(
                    config, vp_stage=s // pp if vp > 1 else None, pp_rank=s % pp
                )
                for s in range(pp * vp)
            ]
        except Exception as exc:  # the engine's refusal, whatever it raises
            message = " ".join(str(exc).split())[:400]
            return [
                error(
                    ENGINE_KEY,
                    f"the engine's own verdict: {where} refuses it: "
                    f"{type(exc).__name__}: {message}",
                    "the findings beside this one name the flag",
                )
            ]
    return _split_findings(where, stages, layers, pp, flags)


def _split_findings(
    where: str, stages: list[int], layers: int, pp: int, flags: dict[str, Any]
) -> list[Finding]:
    accepted = info(ENGINE_KEY, f"the engine's own verdict: {where} accepts it")
    if pp < 2:
        return [accepted]
    built = f"get_num_layers_to_build puts {stages} layers on its {len(stages)} pipeline stages"
    ours, _, _ = megatron_split.pipeline_split(layers, pp, flags)
    if ours is not None and ours != stages:
        return [
            accepted,
            warning(
                ENGINE_KEY,
                f"Megatron-Core's {built}; dstrain's reading of the split says {ours}: "
                "Megatron-Core's own count stands, dstrain's is wrong here",
                "report it to dstrain with the script",
            ),
        ]
    return [accepted, info(ENGINE_KEY, f"Megatron-Core's {built}, as dstrain reads it")]


def _config_kwargs(flags: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """TransformerConfig's arguments from the flags, and the architecture flags the script left
    out (stand-ins given: a layout check must not fail on a size the script never set)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name: str(f.type) for f in dataclasses.fields(TransformerConfig)}
    kwargs: dict[str, Any] = {}
    for flag, value in flags.items():
        name = _RENAMED.get(flag, _STORE_FALSE.get(flag, flag))
        if name not in fields or name in _DERIVED or not _known(value):
            continue
        if isinstance(value, str) and "str" not in fields[name]:
            continue  # an expression argparse would evaluate (--moe-layer-freq "[0]+[1]*3")
        kwargs[name] = (not value) if flag in _STORE_FALSE else value
    if flags.get("group_query_attention") is not True:
        kwargs.pop("num_query_groups", None)
    parallel = 1
    for name in ("tensor_model_parallel_size", "context_parallel_size"):
        parallel *= kwargs.get(name, 1) if _whole(kwargs.get(name, 1)) else 1
    placeholders = []
    if "num_attention_heads" not in kwargs:
        kwargs["num_attention_heads"] = 8 * parallel
        placeholders.append("--num-attention-heads")
    if "hidden_size" not in kwargs:
        kwargs["hidden_size"] = 64 * kwargs["num_attention_heads"]
        placeholders.append("--hidden-size")
    return kwargs, placeholders


# Fields validate_args derives rather than copies: set from the flags above, not passed as is.
_DERIVED = {"virtual_pipeline_model_parallel_size", "params_dtype", "pipeline_dtype"}


def _dtypes(flags: dict[str, Any]) -> dict[str, Any]:
    """params_dtype and pipeline_dtype, as Megatron-LM derives them from --bf16 / --fp16."""
    import torch

    dtype = torch.float32
    if flags.get("bf16") is True:
        dtype = torch.bfloat16
    elif flags.get("fp16") is True:
        dtype = torch.float16
    return {"params_dtype": dtype, "pipeline_dtype": dtype}


def _known(value: Any) -> bool:
    """A value the script set (not a $VARIABLE left unresolved)."""
    return value is not None and not (isinstance(value, str) and "$" in value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
