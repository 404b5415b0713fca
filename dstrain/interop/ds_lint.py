"""Checks of a DeepSpeed config against what DeepSpeed itself accepts: unknown or misplaced keys
(with the closest valid key), deprecated spellings, optimizer/scheduler params per type, and the
combinations DeepSpeed's engine refuses at start-up."""

import json
import re
from typing import Any

from dstrain.config.findings import Finding, error, info, warning
from dstrain.config.suggest import closest
from dstrain.interop import megatron
from dstrain.interop.ds_engine import engine_rules
from dstrain.interop.ds_keys import (
    DS_DEPRECATED,
    DS_OPAQUE_SECTIONS,
    DS_OPTIMIZER_PARAMS,
    DS_REJECTED_OPTIMIZER_PARAMS,
    DS_SCHEDULER_PARAMS,
    DS_SECTION_KEYS,
    DS_TOP_LEVEL,
    Release,
)

REJECTED_OPTIMIZER_PARAMS = DS_REJECTED_OPTIMIZER_PARAMS
HINT = (
    "judge by another release with --deepspeed-release 0.18.9 (or 0.16.9): the rules differ "
    "for removed features, 1-bit optimizers and the fp16/bf16 sections"
)

# What importing a DeepSpeed/Megatron file checks, for `dstrain check --rules`.
IMPORT_RULES = (
    (
        "ds_unknown_keys",
        "Every key is one DeepSpeed or Megatron-LM accepts; a typo names the "
        "closest valid key, a misplaced key names its section.",
    ),
    (
        "ds_deprecated_keys",
        "Deprecated spellings (cpu_offload, ...) are mapped, with the new name.",
    ),
    (
        "ds_optimizer_params",
        "Optimizer and scheduler params are those of their type; "
        "max_grad_norm is refused as DeepSpeed refuses it.",
    ),
    ("ds_one_bit_with_zero", "1-bit Adam/LAMB and 0/1 Adam run only without ZeRO."),
    ("ds_zero_with_pipeline", "DeepSpeed's PipelineEngine takes ZeRO stage 0 or 1 only."),
    (
        "ds_half_precision",
        "fp16 and bf16 are not both on; bf16 has no loss-scaling keys; fp16 "
        "hard-coded in an `auto` (HF Trainer) file is flagged.",
    ),
    (
        "ds_batch_keys",
        "A batch size is given; `auto` train_batch_size comes with an `auto` "
        "gradient_accumulation_steps.",
    ),
    ("ds_offload_stage", "offload_param has no effect below stage 3."),
    (
        "ds_string_switches",
        'A switch written as a string: "false" is on where DeepSpeed reads it with dict.get.',
    ),
    (
        "ds_offload_optimizer",
        "ZeRO-Offload with the launcher's own optimizer; partial offload on NVMe.",
    ),
    ("ds_zeropp", "ZeRO++ quantized gradients need reduce_scatter."),
    (
        "megatron_engine",
        "Megatron-LM / Megatron-DeepSpeed's own refusals and inferences from a script's flags "
        "(docs/check.md lists them with their sources).",
    ),
)

# torch.optim classes DeepSpeed falls back to when `type` is not one of its own optimizers.
_TORCH_OPTIMIZERS = {
    "sgd",
    "adagrad",
    "adadelta",
    "adamax",
    "asgd",
    "lbfgs",
    "nadam",
    "radam",
    "rmsprop",
    "rprop",
    "sparseadam",
    "adafactor",
}
_LEGACY = {
    "amp",
    "curriculum_learning",
    "elasticity",
    "nebula",
    "sparse_attention",
    "eigenvalue",
    "progressive_layer_drop",
}


# Keys of the tools around DeepSpeed that users put in its JSON, where DeepSpeed ignores them.
_NEIGHBOUR_KEYS = {
    "zero3_init_flag": "an Accelerate config key (accelerate config's deepspeed_config section)",
    "zero3_save_16bit_model": "an Accelerate config key (accelerate config's deepspeed_config)",
    "dist_init_required": "an argument of deepspeed.initialize(), not of its config",
    "deepspeed_multinode_launcher": "an Accelerate config key (the multi-node launcher)",
}


def top_level_keys() -> frozenset[str]:
    return DS_TOP_LEVEL


def lint(raw: dict[str, Any], rel: Release) -> list[Finding]:
    findings: list[Finding] = []
    for key in raw:
        findings.extend(_top_level_key(key))
    lenient = {} if rel.pydantic_precision else _LENIENT_SECTIONS
    for section in sorted(DS_SECTION_KEYS, key=len):
        node = _lookup(raw, section)
        if isinstance(node, dict) and section not in ("optimizer", "scheduler"):
            findings.extend(_section_keys(section, node, lenient))
    findings.extend(_optimizer(raw.get("optimizer")))
    findings.extend(_scheduler(raw.get("scheduler")))
    findings.extend(engine_rules(raw, rel))
    return findings


def _top_level_key(key: str) -> list[Finding]:
    if key in DS_TOP_LEVEL or megatron.is_megatron_key(key):
        return []
    if key in DS_DEPRECATED:
        return [_deprecated(key)]
    if key in _NEIGHBOUR_KEYS:
        return [info(key, f"not a DeepSpeed key, ignored by DeepSpeed: {_NEIGHBOUR_KEYS[key]}")]
    home = _home_of(key)
    if home and home != "the top level":
        return [
            warning(
                key,
                f"`{key}` is a key of {home}, not of the top level: DeepSpeed ignores it here, "
                "so it has no effect",
                f"move it into {home}, or remove it",
            )
        ]
    # DeepSpeed reads each top-level key with a plain dict.get (get_scalar_param in
    # deepspeed/runtime/config_utils.py) and never looks at the others: an unknown one is
    # ignored, so it is a warning (a typo still names the key it was meant to be). The sections
    # are pydantic models with extra="forbid" (DeepSpeedConfigModel): unknown keys there fail.
    vocabulary = set(DS_TOP_LEVEL) | megatron.known_keys()
    finding = _unknown(key, key, "the top level", vocabulary)
    return [
        warning(
            finding.key,
            f"{finding.message}; DeepSpeed ignores unknown top-level keys, so it has no effect",
            finding.fix,
        )
    ]


def _section_keys(section: str, node: dict[str, Any], lenient: dict[str, str]) -> list[Finding]:
    if section in DS_OPAQUE_SECTIONS:
        return []
    valid = DS_SECTION_KEYS[section]
    findings = []
    for key in node:
        dotted = f"{section}.{key}"
        if key in valid or dotted in DS_SECTION_KEYS or _is_opaque(dotted):
            continue
        if dotted in DS_DEPRECATED:
            findings.append(_deprecated(dotted))
        elif section in lenient:
            found = _unknown(dotted, key, f"`{section}`", valid)
            message = f"{found.message}; {lenient[section]}"
            findings.append(warning(found.key, message, found.fix))
        else:
            findings.append(_unknown(dotted, key, f"`{section}`", valid))
    return findings


# Sections a release before 0.17.3 read with dict.get, ignoring unknown keys (as apex-era configs
# with opt_level relied on); DeepSpeedFP16Config / DeepSpeedBF16Config (precision_config.py,
# pydantic with extra=forbid) refuse them from 0.17.3 on.
_LENIENT_SECTIONS = {
    section: f"this release reads `{section}` with dict.get and ignores it (0.17.3+ refuse it)"
    for section in ("fp16", "bf16")
}


def _optimizer(section: Any) -> list[Finding]:
    if not isinstance(section, dict):
        return []
    findings = [
        _unknown(f"optimizer.{k}", k, "`optimizer`", {"type", "params"})
        for k in section
        if k not in ("type", "params", "legacy_fusion")
    ]
    kind = str(section.get("type", ""))
    accepted = DS_OPTIMIZER_PARAMS.get(kind.lower())
    if accepted is None and kind.lower() not in _TORCH_OPTIMIZERS:
        names = list(DS_OPTIMIZER_PARAMS) + sorted(_TORCH_OPTIMIZERS)
        match = closest(kind, names)
        hint = f" (did you mean `{match}`?)" if match else ""
        findings.append(
            error("optimizer.type", f"unknown optimizer `{kind}`{hint}", "use e.g. AdamW or Adam")
        )
    params = section.get("params")
    if isinstance(params, dict):
        findings.extend(_optimizer_params(kind, params, accepted))
    return findings


def _optimizer_params(
    kind: str, params: dict[str, Any], accepted: frozenset[str] | None
) -> list[Finding]:
    findings = []
    for name in params:
        key = f"optimizer.params.{name}"
        if name in DS_REJECTED_OPTIMIZER_PARAMS:
            findings.append(
                error(
                    key,
                    f"`{name}` is not an optimizer parameter: DeepSpeed raises a ValueError for it",
                    DS_REJECTED_OPTIMIZER_PARAMS[name],
                )
            )
        elif accepted is not None and name not in accepted:
            findings.append(_unknown(key, name, f"{kind}'s params", accepted))
    return findings


def _scheduler(section: Any) -> list[Finding]:
    if not isinstance(section, dict):
        return []
    findings = [
        _unknown(f"scheduler.{k}", k, "`scheduler`", {"type", "params"})
        for k in section
        if k not in ("type", "params")
    ]
    kind = str(section.get("type", ""))
    accepted = DS_SCHEDULER_PARAMS.get(kind)
    if accepted is None:
        match = closest(kind, DS_SCHEDULER_PARAMS)
        hint = f" (did you mean `{match}`?)" if match else ""
        findings.append(
            error(
                "scheduler.type",
                f"unknown scheduler `{kind}`{hint}",
                f"use one of {', '.join(DS_SCHEDULER_PARAMS)}",
            )
        )
        return findings
    params = section.get("params")
    if isinstance(params, dict):
        findings += [
            _unknown(f"scheduler.params.{k}", k, f"{kind}'s params", accepted)
            for k in params
            if k not in accepted
        ]
    return findings


def _unknown(dotted: str, key: str, where: str, valid: Any) -> Finding:
    pool = set(valid)
    match = closest(key, pool)
    if match and match != key:
        return error(
            dotted,
            f"unknown key `{key}` in {where} (did you mean `{match}`?)",
            f"rename it to `{match}`",
        )
    home = _home_of(key)
    if home:
        return error(
            dotted,
            f"`{key}` does not belong in {where}: it is a key of {home} (DeepSpeed rejects or "
            "ignores it here)",
            f"move it to {home}, or remove it",
        )
    shown = ", ".join(sorted(pool)[:12]) + (", ..." if len(pool) > 12 else "")
    return error(dotted, f"unknown key `{key}` in {where}", f"valid keys there: {shown}")


def _home_of(key: str) -> str | None:
    """Where a misplaced key belongs: the top level, or the first section that has it (current
    sections before legacy ones such as `amp`)."""
    if key in DS_TOP_LEVEL:
        return "the top level"
    for section, keys in sorted(DS_SECTION_KEYS.items(), key=lambda kv: (kv[0] in _LEGACY, kv[0])):
        if key in keys:
            return f"`{section}`"
    return None


def _deprecated(dotted: str) -> Finding:
    return warning(
        dotted,
        f"`{dotted}` is a deprecated DeepSpeed spelling",
        f"use `{DS_DEPRECATED[dotted]}`"
        if not DS_DEPRECATED[dotted].startswith("use ")
        else DS_DEPRECATED[dotted],
    )


def _is_opaque(dotted: str) -> bool:
    return any(dotted == s or dotted.startswith(f"{s}.") for s in DS_OPAQUE_SECTIONS)


def _lookup(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


# ----------------------------------------------------------------------------- the file's text
# DeepSpeed reads a --deepspeed_config file with hjson (runtime/config.py, DeepSpeedConfig:
# `hjson.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys)`): comments, trailing
# commas and a newline in place of a comma are accepted, a duplicate key is refused. The HF
# Trainer and Accelerate read the file with json.load instead, which refuses the former and
# keeps the last of duplicates.
_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"|//[^\n]*|#[^\n]*|/\*.*?\*/|\n|[{}\[\],:]|[^\s"/#{}\[\],:]+|\S', re.S
)


def read_hjson(text: str) -> tuple[dict[str, Any] | None, list[Finding]]:
    """The file as DeepSpeed's loader reads it: (None, []) when it is not JSON-like at all, or
    (the dict, findings on what plain JSON would refuse, duplicates included)."""
    out, used, line = [], set(), 1
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token.startswith(("//", "#", "/*")):
            used.add(f"a comment (line {line})")
            line += token.count("\n")
            continue
        if token == "\n":
            line += 1
            if out and _ends_value(out[-1]):
                out.append("\n")  # maybe a comma hjson infers; decided at the next token
            continue
        if token in "}]" and out and out[-1] == "\n":
            out.pop()
        if token in "}]" and out and out[-1] == ",":
            used.add(f"a trailing comma (line {line})")
            out.pop()
        if out and out[-1] == "\n":
            out[-1] = ","
            if token not in (",", ":"):
                used.add(f"a missing comma at the end of line {line - 1}")
            else:
                out.pop()
        out.append(token)
    return _load_pairs("".join(t for t in out if t != "\n"), sorted(used))


def _ends_value(token: str) -> bool:
    return token[-1] in '"}]' or token[-1].isalnum() or token[-1] == "."


def _load_pairs(text: str, used: list[str]) -> tuple[dict[str, Any] | None, list[Finding]]:
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        duplicates.extend(sorted({k for k in keys if keys.count(k) > 1}))
        return dict(items)

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError:
        return None, []
    if not isinstance(data, dict):
        return None, []
    findings = []
    if used:
        findings.append(
            warning(
                "(file)",
                f"not plain JSON: {', '.join(used)}. DeepSpeed's own loader reads the file with "
                "hjson and accepts it (through --deepspeed_config), but json.load refuses it, "
                "and that is how the HF Trainer and Accelerate read a config file",
                "write plain JSON: no comments, no trailing commas, a comma after every entry",
            )
        )
    if duplicates:
        findings.append(
            error(
                duplicates[0],
                f"duplicate key(s) {', '.join(f'`{k}`' for k in duplicates)}: DeepSpeed refuses "
                "the file (`Duplicate keys in DeepSpeed config`); json.load (the HF Trainer) "
                "silently keeps the last one",
                "keep one entry per key",
            )
        )
    return data, findings
