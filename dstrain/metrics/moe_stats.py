"""Expert-load figures of one MoE layer, from the tokens each expert received in a step."""

import re

import torch

_WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod", "_fsdp_wrapped_module.", "module.")


def layer_label(router_name: str) -> str:
    """`layers.3.moe.router` (under any wrapper: activation checkpointing, compile, DDP) ->
    `layer3`; the MoE of MTP module k (`mtp.1.block...`) -> `mtp1`; any other router -> its
    dotted path with dots as underscores."""
    plain = router_name
    for wrapper in _WRAPPERS:
        plain = plain.replace(wrapper, "")
    for prefix, label in (("layers", "layer"), ("mtp", "mtp")):
        match = re.match(rf"{prefix}\.(\d+)\.", plain)
        if match:
            return f"{label}{match.group(1)}"
    return plain.removesuffix(".router").replace(".", "_")


def load_stats(tokens: torch.Tensor) -> dict[str, float | list[float]]:
    """tokens_per_expert, max_over_mean, cv (std / mean, population std) and dead_experts; empty
    when the layer saw no token."""
    load = tokens.detach().double().cpu()
    mean = load.mean().item()
    if mean <= 0:
        return {}
    return {
        "tokens_per_expert": load.tolist(),
        "max_over_mean": load.max().item() / mean,
        "cv": load.std(unbiased=False).item() / mean,
        "dead_experts": float((load == 0).sum().item()),
    }
