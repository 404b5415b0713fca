"""Reading a Megatron/DeepSpeed launch script (bash or Slurm) as a config.

Large runs are often described only by their launch script: shell variables, Megatron flags
(`--tensor-model-parallel-size $TP_SIZE`), a DeepSpeed JSON written by a heredoc, and `#SBATCH`
lines that fix the node count. This module expands the variables the script assigns itself,
collects the Megatron flags and the heredoc JSON, and reads the cluster shape, so `check` judges
the run the script would launch. It does not run the script, so what comes from elsewhere stays
unresolved and is named, never guessed: variables the script does not assign (set in the
environment, a sourced file or a wrapper), positional arguments (`$1`, `$@`), command output
(`$(nproc)`, backticks) and sourced files. A flag or JSON value built on one is left unchecked.
"""

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from dstrain.config.findings import error, info
from dstrain.interop import megatron, megatron_engine, megatron_verdict
from dstrain.interop.deepspeed import from_deepspeed
from dstrain.interop.imported import DEFAULT_JUDGES, Imported, Judges

_ASSIGN = re.compile(r"^\s*(?:export\s+|local\s+|declare\s+(?:-\w+\s+)?)?([A-Za-z_]\w*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?::?-([^}]*))?\}|\$([A-Za-z_]\w*)")
_POSITIONAL = re.compile(r"\$\{?([0-9@*#])\}?")
_COMMAND = re.compile(r"\$\((?!\()([^()]*(?:\([^()]*\)[^()]*)*)\)|`([^`]*)`")
_SOURCE = re.compile(r"^\s*(?:source|\.)\s+(\S+)")
# What an unresolved reference expands to: one shell word, recognisable in flag and JSON values.
_PLACEHOLDER = re.compile(r"<\?([^<>\s]+)>")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_ARITH = re.compile(r"\$\(\(([^()]*)\)\)")
_GPU_NAMES = {"a100": "A100-80GB", "h100": "H100", "h800": "H800", "h200": "H200", "v100": "V100"}


@dataclass
class ScriptFacts:
    """What a launch script says: Megatron flags, a DeepSpeed JSON, and the cluster shape."""

    flags: dict[str, Any] = field(default_factory=dict)
    deepspeed: dict[str, Any] | None = None
    deepspeed_error: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    gpu: str | None = None
    unresolved: set[str] = field(default_factory=set)  # variables the script does not assign
    defaulted: dict[str, str] = field(default_factory=dict)  # ${VAR:-default}: the default used
    positional: set[str] = field(default_factory=set)  # $1, $@: the script's own arguments
    commands: set[str] = field(default_factory=set)  # $(...) and `...` whose output is unknown
    sourced: list[str] = field(default_factory=list)  # files read with `source` / `.`
    unchecked: dict[str, str] = field(default_factory=dict)  # flag -> the text it could not get
    nemo_overrides: dict[str, Any] = field(default_factory=dict)  # NeMo's Hydra overrides
    swift: bool = False  # ms-swift's `megatron sft|pt|rlhf` launcher (Megatron-SWIFT)
    spellings: dict[str, str] = field(default_factory=dict)  # flag -> as written, no dashes


def read_launch_script(text: str) -> ScriptFacts:
    facts = ScriptFacts()
    lines, heredocs = _logical_lines(text)
    variables = _slurm_variables(lines, facts)
    body: list[str] = []
    for line in lines:
        if source := _SOURCE.match(line):
            facts.sourced.append(source.group(1))
            continue
        match = _ASSIGN.match(line)
        if match and (command := _env_prefixed(line, variables, facts)) is not None:
            body.append(command)  # `NPROC_PER_NODE=8 NNODES=2 megatron sft ...`
        elif match:
            value = _expand(_unquote(match.group(2)), variables, facts)
            variables[match.group(1)] = value
            body.append(value)
        elif not line.lstrip().startswith("#"):
            body.append(_expand(line, variables, facts))
    for doc in heredocs:
        _read_heredoc(_expand(doc, variables, facts), facts)
    _collect_flags(" ".join(body), facts)
    _cluster_from_launchers(facts, variables)
    return facts


def _env_prefixed(line: str, variables: dict[str, str], facts: ScriptFacts) -> str | None:
    """A command run with environment assignments in front (`A=1 B=2 cmd --flag`): the
    assignments are the script's variables, the rest the command; None for a plain `A=1`
    (and for `A=$(cmd ...)`, whose spaces are the substitution's, not a command's)."""
    if "$(" in line or "`" in line:
        return None
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    n = 0
    while n < len(words) and re.fullmatch(r"[A-Za-z_]\w*=.*", words[n]):
        n += 1
    if n == 0 or n == len(words):
        return None
    for word in words[:n]:
        name, _, value = word.partition("=")
        variables[name] = _expand(value, variables, facts)
    return _expand(shlex.join(words[n:]), variables, facts)


def _logical_lines(text: str) -> tuple[list[str], list[str]]:
    """Lines with backslash continuations joined, heredoc bodies set apart."""
    lines: list[str] = []
    heredocs: list[str] = []
    pending = ""
    raw = text.splitlines()
    i = 0
    while i < len(raw):
        line = raw[i]
        i += 1
        marker = _HEREDOC.search(line)
        if marker and not line.lstrip().startswith("#"):
            end = marker.group(1)
            doc = []
            while i < len(raw) and raw[i].strip() != end:
                doc.append(raw[i])
                i += 1
            i += 1
            heredocs.append("\n".join(doc))
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    if pending:
        lines.append(pending)
    return lines, heredocs


def _slurm_variables(lines: list[str], facts: ScriptFacts) -> dict[str, str]:
    """#SBATCH --nodes/--gres/--constraint, exposed as the SLURM_* variables scripts read."""
    for line in lines:
        if not line.startswith("#SBATCH"):
            continue
        text = line.split("#", 2)[1].removeprefix("SBATCH")
        for option in re.finditer(r"(--[\w-]+|-N)[=\s]+(\S+)", text):
            name, value = option.groups()
            if name in ("--nodes", "-N") and value.split("-")[0].isdigit():
                facts.nodes = int(value.split("-")[0])
            elif name in ("--gres", "--gpus-per-node") and (m := re.search(r"(\d+)$", value)):
                facts.gpus_per_node = int(m.group(1))
            elif name == "--constraint":
                facts.gpu = _GPU_NAMES.get(value.lower().strip("'\""), facts.gpu)
    variables = {}
    if facts.nodes:
        variables |= {"SLURM_NNODES": str(facts.nodes), "SLURM_JOB_NUM_NODES": str(facts.nodes)}
    if facts.gpus_per_node:
        variables["SLURM_GPUS_ON_NODE"] = str(facts.gpus_per_node)
    return variables


def _unquote(value: str) -> str:
    value = value.strip()
    try:
        parts = shlex.split(value, comments=True)
    except ValueError:
        return value
    return " ".join(parts)


def _expand(text: str, variables: dict[str, str], facts: ScriptFacts) -> str:
    for _ in range(10):  # nested references: A="$B", B="$C"
        expanded = _VAR.sub(lambda m: _lookup(m, variables, facts), text)
        expanded = _ARITH.sub(lambda m: _arithmetic(m, variables), expanded)
        expanded = _COMMAND.sub(lambda m: _command(m, facts), expanded)
        expanded = _POSITIONAL.sub(lambda m: _positional(m, facts), expanded)
        if expanded == text:
            break
        text = expanded
    return text


def _lookup(match: re.Match[str], variables: dict[str, str], facts: ScriptFacts) -> str:
    name = match.group(1) or match.group(3)
    if name in variables:
        return variables[name]
    if match.group(2) is not None:
        facts.defaulted[name] = match.group(2)  # the environment may set another
        return match.group(2)
    facts.unresolved.add(name)
    return f"<?{name}>"


def _command(match: re.Match[str], facts: ScriptFacts) -> str:
    command = (match.group(1) or match.group(2) or "").strip()
    facts.commands.add(command)
    word = re.sub(r"[^\w.-]+", "_", command)[:40]
    return f"<?output-of:{word}>"


def _positional(match: re.Match[str], facts: ScriptFacts) -> str:
    facts.positional.add(f"${match.group(1)}")
    return f"<?arg{match.group(1)}>"


def _arithmetic(match: re.Match[str], variables: dict[str, str]) -> str:
    """`$((GBS * 1000))`: bash arithmetic, where bare names are variables."""
    expression = re.sub(
        r"[A-Za-z_]\w*", lambda m: variables.get(m.group(0), m.group(0)), match.group(1)
    ).replace(" ", "")
    if re.fullmatch(r"[\d+\-*/()]+", expression) and "**" not in expression:
        try:
            return str(int(eval(expression, {"__builtins__": {}})))  # digits and + - * / only
        except (SyntaxError, ZeroDivisionError):
            pass
    return match.group(0)


def _read_heredoc(doc: str, facts: ScriptFacts) -> None:
    if not doc.lstrip().startswith("{"):
        return
    # An unresolved value (`"train_batch_size": $GBS` with GBS set elsewhere) is not a JSON
    # error of the user's: it becomes a string that `import_launch_script` leaves unchecked.
    doc = re.sub(r'([:\[,]\s*)(<\?[^<>\s"]+>)', r'\1"\2"', doc)
    try:
        data = json.loads(doc)
    except json.JSONDecodeError as exc:
        facts.deepspeed_error = f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
        return
    if isinstance(data, dict):
        facts.deepspeed = data


def _collect_flags(text: str, facts: ScriptFacts) -> None:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        tokens = text.split()
    facts.swift = _SWIFT.search(" ".join(tokens)) is not None
    for i, token in enumerate(tokens):
        if _HYDRA.match(token):
            _nemo_override(token, facts)
            continue
        if not token.startswith("--") or len(token) < 3:
            continue
        name, eq, inline = token[2:].partition("=")
        if eq:
            value: Any = inline
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value = tokens[i + 1]
            if _FLAG_BUNDLE.fullmatch(value):
                value = True  # `--checkpoint-activations $DS_ARGS`: a switch, then more flags
        else:
            value = True
        if facts.swift and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"  # ms-swift parses booleans as values
        facts.flags[name.replace("-", "_")] = _literal(value)
        facts.spellings[name.replace("-", "_")] = name


# An unresolved variable that holds a bundle of flags, not one value (`$DS_ARGS`, `$GPT_OPTS`).
_FLAG_BUNDLE = re.compile(r"<\?\w*(?:ARGS|OPTS|OPTIONS|FLAGS|PARAMS|CONFIGS?)>", re.IGNORECASE)
# ms-swift's Megatron launchers: `megatron sft ...`, `megatron pt`, `megatron rlhf`, and the
# console script `megatron_sft`; their flags are Megatron-LM's with booleans given as values.
_SWIFT = re.compile(
    r"(?:^|\s)(?:megatron\s+(?:sft|pt|rlhf|export)|megatron_(?:sft|pt|rlhf))(?:\s|$)"
)
# NeMo's Hydra overrides (`model.tensor_model_parallel_size=2`, `trainer.devices=8`; NeMo 2's
# `trainer.strategy.pipeline_model_parallel_size=4`), `+`/`++` prefixed or not.
_HYDRA = re.compile(r"^\+{0,2}(model|trainer)\.[\w.]+=")
# NeMo's names where they differ from Megatron-LM's argument names (megatron_gpt_config.yaml).
_NEMO_NAMES = {
    "encoder_seq_length": "seq_length",
    "num_moe_experts": "num_experts",
    # Megatron-Core TransformerConfig names (NeMo 2, Megatron-Bridge)
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
}
_NEMO_PRECISION = {"bf16": "bf16", "bf16-mixed": "bf16", "16": "fp16", "16-mixed": "fp16"}


def _nemo_override(token: str, facts: ScriptFacts) -> None:
    """One Hydra override of a NeMo launch: Megatron settings under model./trainer.strategy.,
    the cluster shape under trainer."""
    dotted, _, text = token.lstrip("+").partition("=")
    value = _literal(text.strip("'\""))
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    facts.nemo_overrides[dotted] = value
    name = dotted.rsplit(".", 1)[1]
    if dotted == "trainer.devices" and isinstance(value, int):
        facts.gpus_per_node = value
    elif dotted == "trainer.num_nodes" and isinstance(value, int):
        facts.nodes = value
    elif dotted == "trainer.precision" and str(value) in _NEMO_PRECISION:
        facts.flags[_NEMO_PRECISION[str(value)]] = True
    elif dotted.startswith(("model.", "trainer.strategy.")):
        facts.flags[_NEMO_NAMES.get(name, name)] = value


def _literal(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _cluster_from_launchers(facts: ScriptFacts, variables: dict[str, str]) -> None:
    """torchrun/deepspeed launcher flags, when #SBATCH did not say; ms-swift's launcher reads
    the NPROC_PER_NODE and NNODES environment variables instead."""
    flags = facts.flags
    if facts.swift:
        for name, attr in (("NPROC_PER_NODE", "gpus_per_node"), ("NNODES", "nodes")):
            if getattr(facts, attr) is None and variables.get(name, "").isdigit():
                setattr(facts, attr, int(variables[name]))
        if facts.gpus_per_node and facts.nodes is None and "NNODES" not in variables:
            facts.nodes = 1  # ms-swift's launcher: NNODES defaults to 1 (one node)
    for key in ("nproc_per_node", "num_gpus"):
        if facts.gpus_per_node is None and isinstance(flags.get(key), int):
            facts.gpus_per_node = flags[key]
    for key in ("nnodes", "num_nodes"):
        if facts.nodes is None and isinstance(flags.get(key), int):
            facts.nodes = flags[key]


def import_launch_script(text: str, judges: Judges = DEFAULT_JUDGES) -> Imported:
    """The script's DeepSpeed JSON and Megatron flags, mapped like a DeepSpeed file, plus the
    cluster shape; flags of other programs (srun, torchrun) are listed once, not dropped."""
    facts = read_launch_script(text)
    raw = _resolved(dict(facts.deepspeed or {}), "", facts)
    others = []
    for name, value in facts.flags.items():
        if isinstance(value, str) and _PLACEHOLDER.search(value):
            facts.unchecked[f"--{name.replace('_', '-')}"] = value
        elif megatron.is_megatron_key(name):
            raw.setdefault(name, value)
        else:
            others.append(f"--{name}")
    engine = _engine(facts, text)
    # The engine picks the rule set: DeepSpeed's own rules judge only a DeepSpeed config the
    # script writes and hands to Megatron-DeepSpeed. A script that launches no DeepSpeed, or
    # names a JSON this check does not read, gets Megatron's rules alone.
    if engine == "Megatron-DeepSpeed" and facts.deepspeed is not None:
        out = from_deepspeed(raw, engine, judges=judges)
    else:
        out = megatron.import_flags(raw, engine)
    out.findings.extend(megatron_engine.engine_rules(engine, facts.flags, facts.deepspeed))
    out.findings.extend(megatron_verdict.engine_verdict(engine, facts.flags))
    unknown = [o.removeprefix("--") for o in others]
    out.findings.extend(megatron_engine.misspelt_flags(engine, unknown, megatron.known_keys()))
    out.findings.extend(
        megatron_engine.spelling_rules(engine, facts.spellings, megatron.known_keys())
    )
    if facts.deepspeed_error:
        out.findings.append(
            error(
                "deepspeed_config",
                f"the DeepSpeed JSON in the script's heredoc is invalid at {facts.deepspeed_error}",
                "fix the JSON between the heredoc markers",
            )
        )
    for key, value in (
        ("nodes", facts.nodes),
        ("gpus_per_node", facts.gpus_per_node),
        ("gpu", facts.gpu),
    ):
        if value is not None:
            out.set(f"cluster.{key}", value, "#SBATCH")
    if others:
        out.findings.append(info("script", f"flags of other programs, ignored: {' '.join(others)}"))
    out.findings.extend(_unresolved_notes(facts))
    return out


def _engine(facts: ScriptFacts, text: str) -> str:
    """NeMo for Hydra overrides; Megatron-DeepSpeed when the script runs Megatron-DeepSpeed
    (it hands Megatron a DeepSpeed config, uses the `deepspeed` launcher, a flag only that fork
    has, or its repository's path); Megatron-LM otherwise."""
    if facts.nemo_overrides:
        return "NeMo"
    if facts.swift:
        return "ms-swift"
    if (
        facts.deepspeed is not None
        or _MDS_FLAGS & set(facts.flags)
        or _DEEPSPEED_LAUNCHER.search(text.replace("\\\n", " "))
        or "Megatron-DeepSpeed" in text
        or any(_DEEPSPEED_VARIABLE.search(name) for name in facts.unresolved)
    ):
        return "Megatron-DeepSpeed"
    return "Megatron-LM"


# Flags of Megatron-DeepSpeed (megatron/arguments.py, and deepspeed.add_config_arguments) that
# Megatron-LM does not have.
_MDS_FLAGS = frozenset(
    {
        "deepspeed",
        "deepspeed_config",
        "zero_stage",
        "no_pipeline_parallel",
        "deepspeed_activation_checkpointing",
        "partition_activations",
        "contigious_checkpointing",
        "pp_partition_method",
        "ds_sequence_parallel_size",
        "ds_pipeline_enabled",
    }
)
# `deepspeed pretrain_gpt.py ...` / `deepspeed --num_gpus 8 ...`: DeepSpeed's launcher.
_DEEPSPEED_LAUNCHER = re.compile(
    r"(?:^|[\s;&|/])deepspeed[ \t]+(?:--\S+(?:[ \t]+[^-\s]\S*)?[ \t]+)*\S+\.py"
)
# An unassigned variable that carries DeepSpeed's flags (`$DS_ARGS`, `${DEEPSPEED_ARGS}`).
_DEEPSPEED_VARIABLE = re.compile(r"(?i)^(?:ds|deepspeed)(?:_|$)|_ds_|deepspeed")


def _resolved(node: dict[str, Any], prefix: str, facts: ScriptFacts) -> dict[str, Any]:
    """The heredoc JSON without the values an unresolved reference stands in for."""
    kept: dict[str, Any] = {}
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            kept[key] = _resolved(value, f"{dotted}.", facts)
        elif isinstance(value, str) and _PLACEHOLDER.search(value):
            facts.unchecked[dotted] = value
        else:
            kept[key] = value
    return kept


def _unresolved_notes(facts: ScriptFacts) -> list:
    """One note per kind of value the script takes from elsewhere, naming each."""
    notes = []
    if facts.unchecked:
        shown = ", ".join(
            f"{key} {_PLACEHOLDER.sub(lambda m: '$' + m.group(1), value)}"
            for key, value in sorted(facts.unchecked.items())
        )
        notes.append(
            info(
                "script",
                f"not checked, their values come from outside the script: {shown}",
                "pass the values with --set (e.g. --set parallel.tp=8), or check the script "
                "with the variables assigned",
            )
        )
    sources = [
        (
            facts.unresolved,
            "variables the script does not assign (set in the environment or by a caller)",
        ),
        (facts.positional, "the script's own arguments (a wrapper passes them)"),
        (facts.commands, "command output, which check does not run"),
        (set(facts.sourced), "files the script sources, which check does not read"),
    ]
    if facts.nemo_overrides:
        notes.append(
            info(
                "script",
                "a NeMo launch: what its overrides do not set comes from the NeMo config it "
                "names (--config-path/--config-name, or the recipe), which check does not read; "
                "the defaults assumed are Megatron-LM's",
                "add the missing values as overrides (e.g. model.num_layers=...) to check them",
            )
        )
    for names, what in sources:
        if names:
            notes.append(info("script", f"unresolved, {what}: {', '.join(sorted(names))}"))
    if facts.defaulted:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(facts.defaulted.items()))
        notes.append(
            info(
                "script",
                f"took the script's own defaults (${{VAR:-default}}) for {shown}; the "
                "environment it runs in may set others",
            )
        )
    return notes
