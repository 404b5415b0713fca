"""Differential check: `dstrain check`'s offline DeepSpeed rules against DeepSpeed's own loader.

Seeded mutations of the real working DeepSpeed fixtures, made the ways users break configs, are
judged twice: by DeepSpeed itself (hjson read, `DeepSpeedConfig` at the world size the batch
triple implies, `auto` filled as the HF Trainer fills it, and the optimizer checks
`deepspeed.initialize` makes: dstrain.interop.ds_verdict.engine_verdict) and by `check` with the
engine switched off (DSTRAIN_DEEPSPEED_ENGINE=0), so the offline rules alone are measured.

    python benchmarks/deepspeed_differential.py --seed 0 --per-fixture 12 [--initialize]

With --initialize, every config the loader accepts also goes through `deepspeed.initialize` and
one optimizer step on a tiny model (dstrain.interop.ds_initialize, one child process for all): the
engine "starts" a config only if that step runs too.

Needs `pip install deepspeed==0.19.8` (DS_BUILD_OPS=0). Targets: false errors <= 2 % of the
configs the engine starts, misses without any finding <= 10 % of those it refuses, 0 tracebacks.
What deepspeed.initialize checks beyond those (the model, the optimizer's construction) is not
judged; mutations of optimizer/scheduler param values are left out for that reason.
"""

import argparse
import json
import os
import random
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIRS = (
    ROOT / "tests/fixtures/deepspeed/valid",
    Path("/work/shared/fixtures/deepspeed/valid"),
)
_REMOVED = ("amp", "curriculum_learning", "elasticity", "sparse_attention", "eigenvalue")


@dataclass
class Case:
    name: str
    text: str


@dataclass
class Verdict:
    case: str
    engine_ok: bool
    check_exit: int
    findings: int  # errors and warnings
    traceback: str = ""
    initialize: Any = None  # ds_initialize.Answer, with --initialize


def fixtures() -> list[tuple[str, str]]:
    out = []
    for folder in FIXTURE_DIRS:
        for path in sorted(folder.glob("*.json")):
            out.append((f"{folder.parent.name}/{path.stem}", path.read_text()))
    return out


def _leaves(node: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, (*prefix, k))]
    return [(prefix, node)]


def _set(node: dict, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _typo(word: str, rng: random.Random) -> str:
    if len(word) < 4:
        return word + "s"
    i = rng.randrange(1, len(word) - 1)
    return (
        word[:i] + word[i + 1 :]
        if rng.random() < 0.5
        else word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    )


def mutate(text: str, rng: random.Random) -> tuple[str, str]:
    """One user mistake (its kind, the new text)."""
    raw = json.loads(text)
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else None
    kind = rng.choice(_KINDS)
    leaves = [(p, v) for p, v in _leaves(raw) if p and p[0] not in ("optimizer", "scheduler")]
    if kind == "typo_key" and leaves:
        path, value = rng.choice(leaves)
        parent = raw
        for part in path[:-1]:
            parent = parent[part]
        parent[_typo(path[-1], rng)] = parent.pop(path[-1])
    elif kind == "string_number":
        numbers = [
            (p, v) for p, v in leaves if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if numbers:
            path, value = rng.choice(numbers)
            _set(raw, path, rng.choice([str(value), f"{float(value):g}"]))
    elif kind == "string_bool":
        flags = [(p, v) for p, v in leaves if isinstance(v, bool)]
        if flags:
            path, value = rng.choice(flags)
            _set(raw, path, rng.choice([str(value).lower(), str(value), "yes" if value else "no"]))
    elif kind == "offload_device":
        stage = rng.choice([2, 3])
        raw["zero_optimization"] = {**(zero or {}), "stage": stage}
        device = rng.choice(["gpu", "CPU", "disk", "cpu", "nvme"])
        part = rng.choice(["offload_optimizer", "offload_param"])
        raw["zero_optimization"][part] = {"device": device}
        if device == "nvme" and rng.random() < 0.5:
            raw["zero_optimization"][part]["nvme_path"] = "/local_nvme"
    elif kind == "removed_feature":
        raw[rng.choice(_REMOVED)] = {"enabled": rng.random() < 0.5}
    elif kind == "one_bit":
        raw["optimizer"] = {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 100}}
    elif kind == "lamb_loss_scale":
        raw["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
        fp16 = raw.get("fp16") if isinstance(raw.get("fp16"), dict) else {}
        raw["fp16"] = {**fp16, "loss_scale": rng.choice([0, 128, 1024])}
        raw.pop("bf16", None)
    elif kind == "no_batch_keys":
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
            raw.pop(key, None)
    elif kind == "batch_mismatch" and isinstance(raw.get("train_micro_batch_size_per_gpu"), int):
        raw["train_batch_size"] = raw["train_micro_batch_size_per_gpu"] * 3 + 1
        raw["gradient_accumulation_steps"] = 1
    elif kind == "both_precisions":
        raw["fp16"], raw["bf16"] = {"enabled": True}, {"enabled": True}
    elif kind == "zero_stage":
        raw["zero_optimization"] = {**(zero or {}), "stage": rng.choice([4, "2", "3", -1, 2.0])}
    elif kind == "misplaced_key" and zero:
        key = rng.choice(sorted(zero))
        raw[key] = raw["zero_optimization"].pop(key)
    new = json.dumps(raw, indent=2)
    if kind in ("comment", "trailing_comma", "missing_comma", "duplicate_key"):
        return kind, _text_mistake(kind, new, rng)
    return kind, new


def _text_mistake(kind: str, text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    with_comma = [i for i, line in enumerate(lines) if line.endswith(",")]
    if not with_comma:
        return text
    i = rng.choice(with_comma)
    if kind == "comment":
        lines.insert(i + 1, rng.choice(["  // tuned for 8 GPUs", "  # old value: 16", "  /* x */"]))
    elif kind == "missing_comma":
        lines[i] = lines[i][:-1]
    elif kind == "duplicate_key":
        lines.insert(1, lines[1].rstrip(",") + ",")
    else:  # a trailing comma before a closing brace
        closing = [j for j, line in enumerate(lines) if line.strip().startswith("}") and j > 0]
        j = rng.choice(closing) - 1
        if not lines[j].endswith((",", "{")):
            lines[j] += ","
    return "\n".join(lines)


_KINDS = (
    "typo_key", "string_number", "string_bool", "offload_device", "removed_feature", "one_bit",
    "lamb_loss_scale", "no_batch_keys", "batch_mismatch", "both_precisions", "zero_stage",
    "misplaced_key", "comment", "trailing_comma", "missing_comma", "duplicate_key",
)  # fmt: skip


def judge(case: Case, tmp: Path) -> Verdict:
    from dstrain.cli.check import exit_status
    from dstrain.errors import UserError
    from dstrain.interop import ds_verdict
    from dstrain.interop.ds_lint import read_hjson
    from dstrain.interop.load import load_any
    from dstrain.preflight.preflight import preflight

    raw = read_hjson(case.text)[0]
    world = ds_verdict._implied_world(ds_verdict._fill_auto(raw)) if raw is not None else 1
    os.environ[ds_verdict.ENGINE_ENV] = "1"
    engine = ds_verdict.engine_verdict(raw or {}, case.text, world) if raw is not None else []
    engine_ok = bool(engine) and engine[0].severity == "info"
    os.environ[ds_verdict.ENGINE_ENV] = "0"
    path = tmp / "ds_config.json"
    path.write_text(case.text)
    try:
        # DeepSpeedConfig's world size is the data-parallel one; check's counts every rank.
        findings = preflight(load_any(path), world * _model_parallel(raw or {}))
    except UserError as exc:
        return Verdict(case.name, engine_ok, exc.exit_code, 1)
    except Exception:
        return Verdict(case.name, engine_ok, -1, 0, traceback.format_exc())
    loud = sum(f.severity in ("error", "warning") for f in findings)
    return Verdict(case.name, engine_ok, exit_status(findings), loud)


def _model_parallel(raw: dict[str, Any]) -> int:
    tp = raw.get("tensor_parallel") if isinstance(raw.get("tensor_parallel"), dict) else {}
    pp = raw.get("pipeline") if isinstance(raw.get("pipeline"), dict) else {}
    sizes = [tp.get("autotp_size", 1), pp.get("stages", 1)]
    return int(sizes[0] if isinstance(sizes[0], int) and sizes[0] > 0 else 1) * int(
        sizes[1] if isinstance(sizes[1], int) and sizes[1] > 0 else 1
    )


def cases(seed: int, per_fixture: int) -> list[Case]:
    rng = random.Random(seed)
    out = []
    for name, text in fixtures():
        out.append(Case(f"{name}", text))
        for n in range(per_fixture):
            kind, new = mutate(text, rng)
            out.append(Case(f"{name}+{kind}#{n}", new))
    return out


def initialize_all(verdicts: list[Verdict], by_name: dict[str, Case]) -> Counter:
    """Each config the loader accepts, through deepspeed.initialize and one step: a refusal
    there turns the engine's verdict to "refuses". Returns the answers counted by verdict."""
    from dstrain.interop import ds_initialize, ds_verdict
    from dstrain.interop.ds_lint import read_hjson

    started = [v for v in verdicts if v.engine_ok]
    requests = []
    for v in started:
        filled = ds_verdict._fill_auto(read_hjson(by_name[v.case].text)[0])
        requests.append((filled, ds_verdict._implied_world(filled)))
    answers = ds_initialize.initialize(requests)
    for v, answer in zip(started, answers, strict=True):
        v.engine_ok = answer.verdict != ds_initialize.REFUSES
        v.initialize = answer
    return Counter(a.verdict for a in answers)


def summarize(verdicts: list[Verdict]) -> dict[str, Any]:
    starts = [v for v in verdicts if v.engine_ok]
    refuses = [v for v in verdicts if not v.engine_ok]
    false_errors = [v for v in starts if v.check_exit != 0]
    misses = [v for v in refuses if v.check_exit == 0]
    silent = [v for v in misses if v.findings == 0]
    agree = len(verdicts) - len(false_errors) - len(misses)
    return {
        "cases": len(verdicts),
        "agree": agree,
        "engine_starts": len(starts),
        "engine_refuses": len(refuses),
        "false_errors": [v.case for v in false_errors],
        "misses": [v.case for v in misses],
        "misses_without_a_finding": [v.case for v in silent],
        "tracebacks": [v.case for v in verdicts if v.traceback],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-fixture", type=int, default=12, help="mutations per fixture")
    parser.add_argument(
        "--initialize",
        action="store_true",
        help="also run deepspeed.initialize and one step for each config the loader accepts",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import tempfile

    all_cases = cases(args.seed, args.per_fixture)
    with tempfile.TemporaryDirectory() as tmp:
        verdicts = [judge(c, Path(tmp)) for c in all_cases]
    deep = initialize_all(verdicts, {c.name: c for c in all_cases}) if args.initialize else None
    report = summarize(verdicts)
    if deep is not None:
        report["initialize"] = dict(deep)
        report["initialize_unjudged"] = {
            v.case: v.initialize.message
            for v in verdicts
            if v.initialize is not None and v.initialize.verdict == "unjudged"
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    n, starts, refuses = report["cases"], report["engine_starts"], report["engine_refuses"]
    fe, silent = len(report["false_errors"]), len(report["misses_without_a_finding"])
    print(f"cases {n}: agree {report['agree']} ({100 * report['agree'] / n:.0f} %)")
    print(f"false errors: {fe} of {starts} the engine starts ({100 * fe / max(starts, 1):.1f} %)")
    print(
        f"misses: {len(report['misses'])} of {refuses} it refuses, {silent} without any finding "
        f"({100 * silent / max(refuses, 1):.1f} %)"
    )
    print(f"tracebacks: {len(report['tracebacks'])}")
    if deep is not None:
        print(f"deepspeed.initialize and one step, on the configs the loader accepts: {dict(deep)}")
        for case, why in report["initialize_unjudged"].items():
            print(f"  unjudged {case}: {why[:160]}")
    for label in ("false_errors", "misses_without_a_finding", "tracebacks"):
        kinds = Counter(c.split("+")[-1].split("#")[0] for c in report[label])
        if kinds:
            print(f"  {label} by kind: {dict(kinds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
