"""The pre-flight: everything `dstrain check` reports about a loaded config, in milliseconds.

The trainer calls `preflight` too, before any process group exists, and refuses to start on errors.
"""

from dataclasses import replace
from pathlib import Path

from dstrain.config.findings import Finding, error, info
from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import LoadedConfig
from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError
from dstrain.hardware import GPUSpec, gpu_spec
from dstrain.preflight.rules import CheckTarget, run_rules


def preflight(loaded: LoadedConfig, world_size: int | None) -> list[Finding]:
    """Findings from loading plus every rule, for `world_size` ranks (None = unknown)."""
    findings = list(loaded.findings)
    model = _model(loaded, findings)
    _apply_virtual_layers(loaded, model, findings)
    target = CheckTarget(loaded.config, world_size, model, _gpu(loaded), loaded.engine)
    findings.extend(_in_users_words(run_rules(target), loaded.origins))
    if loaded.engine:
        findings = _second_question(findings, loaded.engine)
    return findings


def _second_question(findings: list[Finding], engine: str) -> list[Finding]:
    """An imported config is judged by its own engine first: what only dstrain's trainer refuses
    is `unsupported` (the engine runs it), not an error, and is not said again of a key the
    engine's own rules already refuse."""
    refused = {_users_key(f) for f in findings if f.severity == "error" and not f.trainer_limit}
    out = []
    for f in findings:
        if f.severity == "error" and f.trainer_limit:
            if _users_key(f) in refused:
                continue
            f = f.as_unsupported(engine)
        out.append(f)
    return out


def _users_key(finding: Finding) -> str:
    """The file's own key of a finding: `zero_stage` of `zero_stage (parallel.zero_stage)`."""
    return finding.key.split(" (", 1)[0]


def _in_users_words(findings: list[Finding], origins: dict[str, str]) -> list[Finding]:
    """Name the key of the user's own file next to ours: `zero_optimization.stage
    (parallel.zero_stage)` for a DeepSpeed config."""
    return [
        replace(f, key=f"{origins[f.key]} ({f.key})") if origins.get(f.key) else f for f in findings
    ]


def _model(loaded: LoadedConfig, findings: list[Finding]) -> ModelArgs | None:
    if not loaded.model_given:
        findings.append(
            info(
                "model",
                "the file names no model, so layer, head and expert divisibility are not checked",
                "add --set model.flavor=deepseek-v3 (or another flavor) to check them too",
            )
        )
        return None
    model = loaded.config.model
    from_folder = model.hf_config is None and model.flavor is None and model.init_from is not None
    if from_folder and not (Path(model.init_from) / "config.json").exists():
        return None  # the paths rule names the folder (model.init_from), once
    try:
        return resolve_model_args(model)
    except UserError as exc:
        findings.append(error("model", exc.message, exc.fix))
        return None


def _apply_virtual_layers(
    loaded: LoadedConfig, model: ModelArgs | None, findings: list[Finding]
) -> None:
    """Megatron's num_layers_per_virtual_pipeline_stage becomes num_virtual_stages."""
    per_stage = loaded.virtual_layers_per_stage
    if per_stage is None:
        return
    pp = loaded.config.parallel.pp
    if model is None:
        findings.append(
            info(
                "num_layers_per_virtual_pipeline_stage",
                "becomes parallel.num_virtual_stages = num_layers / (pp x it) once the "
                "model is known",
            )
        )
        return
    stages, rest = divmod(model.num_layers, pp * per_stage)
    if rest or stages < 1:
        findings.append(
            error(
                "num_layers_per_virtual_pipeline_stage",
                f"{model.num_layers} layers do not split into pp={pp} x chunks of {per_stage}",
                f"choose a value that divides num_layers / pp = {model.num_layers / pp:g}",
            )
        )
        return
    loaded.config.parallel.num_virtual_stages = stages
    findings.append(
        info("parallel.num_virtual_stages", f"inferred {stages} virtual stages per rank")
    )


def _gpu(loaded: LoadedConfig) -> GPUSpec | None:
    name = loaded.config.cluster.gpu
    if not name or name.lower() == "cpu":
        return None
    try:
        return gpu_spec(name)
    except UserError:
        return None  # rule_cluster reports the unknown name
