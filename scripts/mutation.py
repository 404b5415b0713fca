"""Mutation testing with cosmic-ray (pinned in the `mutation` extra), module group by group, each
against its own tests: how many mutants of the code the tests kill, and which survive.

    pip install -c constraints.txt -e '.[test,mutation]'
    python scripts/mutation.py --group step               # every mutant: slow (hours for all)
    python scripts/mutation.py --sample 15 --out runs.jsonl  # 15 mutants per module, seeded
    python scripts/mutation.py --table runs.jsonl           # the table of that run
    python scripts/mutation.py --retest runs.jsonl          # its survivors, on today's tests
    python scripts/mutation.py --group rules --json

Each group runs in a copy of the checkout's HEAD (cosmic-ray rewrites files in place), with the
copy first on the path so the mutated sources are the ones imported. A mutant is killed when its
tests fail or time out; "incompetent" (the mutated code does not import or its test command
cannot run) is counted apart. Not in CI: one group takes from minutes to hours on 2 cores.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = "python -m pytest -x -q -p no:cacheprovider -p no:randomly"


@dataclass(frozen=True)
class Module:
    path: str
    tests: tuple[str, ...]


_STEP_TESTS = (
    "tests/unit/test_train_step.py",
    "tests/unit/test_train_parts.py",
    "tests/unit/test_device_discipline.py",
)
_FP8_TESTS = (
    "tests/unit/test_fp8.py",
    "tests/unit/test_fp8_accumulation.py",
    "tests/unit/test_fp8_config.py",
    "tests/unit/test_cuda_rules.py",
)
_HF_TESTS = (
    "tests/unit/test_hf_adapter.py",
    "tests/unit/test_init_from.py",
    "tests/unit/test_hf_parity.py",
)
_CHECKPOINT_TESTS = (
    "tests/unit/test_checkpoint_store.py",
    "tests/unit/test_resume_diff.py",
    "tests/unit/test_ckpt_cli.py",
)

# The modules, each with the tests that claim to cover it: the unit tier, and a distributed
# test where only ranks exercise the code (the vocab-parallel loss, the EP dispatch), so that a
# mutant run takes seconds, not the whole suite's minutes.
GROUPS: dict[str, tuple[Module, ...]] = {
    "step": (
        Module("dstrain/train/step.py", _STEP_TESTS),
        Module(
            "dstrain/train/loss.py",
            (
                "tests/unit/test_train_parts.py",
                "tests/unit/test_evaluation.py",
                "tests/unit/test_document_mask.py",
                "tests/distributed/test_loss_parallel.py",
            ),
        ),
        Module("dstrain/train/loss_scale.py", _STEP_TESTS),
    ),
    "moe": (
        Module(
            "dstrain/model/moe.py",
            (
                "tests/unit/test_model_moe.py",
                "tests/unit/test_model_router.py",
                "tests/unit/test_model_transformer.py",
            ),
        ),
        Module(
            "dstrain/parallel/expert_parallel.py",
            (
                "tests/unit/test_expert_parallel_splits.py",
                "tests/unit/test_device_discipline.py",
                "tests/distributed/test_expert_parallel.py",
            ),
        ),
    ),
    "hf": (
        Module("dstrain/model/hf_load.py", _HF_TESTS),
        Module("dstrain/model/hf_adapter.py", _HF_TESTS),
    ),
    "fp8": (
        Module("dstrain/model/fp8.py", _FP8_TESTS),
        Module("dstrain/model/fp8_linear.py", _FP8_TESTS),
        Module("dstrain/model/fp8_grouped.py", _FP8_TESTS),
    ),
    "checkpoint": (
        Module("dstrain/checkpoint/store.py", _CHECKPOINT_TESTS),
        Module("dstrain/checkpoint/resume.py", _CHECKPOINT_TESTS),
    ),
    "rules": (
        Module(
            "dstrain/preflight/rules.py",
            (
                "tests/unit/test_rules.py",
                "tests/unit/test_fp8_config.py",
                "tests/unit/test_pipeline_overlap.py",
            ),
        ),
    ),
}


@dataclass
class Outcome:
    line: int
    operator: str
    result: str  # killed, survived, incompetent
    diff: str = ""
    occurrence: int = -1  # cosmic-ray's index of this operator's sites in the module


@dataclass
class Report:
    group: str
    module: str
    outcomes: list[Outcome] = field(default_factory=list)
    total_mutants: int = 0
    seconds: float = 0.0

    def counts(self) -> Counter:
        return Counter(o.result for o in self.outcomes)

    def killed_share(self) -> float:
        counts = self.counts()
        judged = counts["killed"] + counts["survived"]
        return counts["killed"] / judged if judged else 0.0


def _copy_of_head(into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _existing(paths: tuple[str, ...], root: Path) -> list[str]:
    return [p for p in paths if (root / p).exists()]


def _work_items(module: str, tests: list[str], workdir: Path) -> list[dict]:
    """Every mutation cosmic-ray would make of `module`: (operator, occurrence, line)."""
    config = workdir / "cr.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{module}"\n'
        "timeout = 120.0\n"
        "excluded-modules = []\n"
        f'test-command = "{PYTEST} {" ".join(tests)}"\n'
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    session = workdir / f"{Path(module).stem}.sqlite"
    session.unlink(missing_ok=True)
    subprocess.run(["cosmic-ray", "init", str(config), str(session)], cwd=workdir, check=True)
    dump = subprocess.run(
        ["cosmic-ray", "dump", str(session)], cwd=workdir, capture_output=True, text=True
    ).stdout
    items = []
    for line in dump.splitlines():
        item, _ = json.loads(line)
        for mutation in item["mutations"]:
            items.append(
                {
                    "module": module,
                    "operator": mutation["operator_name"],
                    "occurrence": mutation["occurrence"],
                    "line": mutation["start_pos"][0],
                }
            )
    return items


def _run_one(item: dict, tests: list[str], workdir: Path, timeout: float) -> Outcome:
    command = [
        "cosmic-ray",
        "mutate-and-test",
        item["module"],
        item["operator"],
        str(item["occurrence"]),
        f"{PYTEST} {' '.join(tests)}",
    ]
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    try:
        done = subprocess.run(
            command, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        subprocess.run(["git", "-C", str(workdir), "checkout", "--", item["module"]], check=False)
        # A mutant that hangs its tests is caught, by the timeout.
        return Outcome(item["line"], item["operator"], "killed", occurrence=item["occurrence"])
    try:
        outcome = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return Outcome(item["line"], item["operator"], "incompetent", occurrence=item["occurrence"])
    result = {"killed": "killed", "survived": "survived"}.get(outcome.get("test_outcome") or "")
    diff = "\n".join(
        line
        for line in (outcome.get("diff") or "").splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )
    return Outcome(
        item["line"], item["operator"], result or "incompetent", diff, item["occurrence"]
    )


def _workdir(tmp: Path) -> Path:
    """A copy of HEAD under git, so that a timed-out mutant's file can be restored."""
    workdir = _copy_of_head(tmp)
    subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
    subprocess.run(["git", "add", "-A"], cwd=workdir, check=True)
    subprocess.run(
        ["git", "-c", "user.name=m", "-c", "user.email=m@m", "commit", "-qm", "head"],
        cwd=workdir,
        check=True,
    )
    return workdir


def run_group(
    name: str,
    sample: int | None,
    seed: int,
    timeout: float,
    out: Path | None = None,
    only: dict[str, set[tuple[str, int]]] | None = None,
) -> list[Report]:
    """Each module of group `name` against its own tests: every mutant, or `sample` of them, or
    (`only`, by module) those of these (operator, occurrence) pairs. With `out`, each module's
    report is appended to it as one JSON line once it is done."""
    reports = []
    with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as tmp:
        workdir = _workdir(Path(tmp))
        for module in GROUPS[name]:
            if only is not None and module.path not in only:
                continue
            began = time.perf_counter()
            tests = _existing(module.tests, workdir)
            items = _work_items(module.path, tests, workdir)
            report = Report(name, module.path, total_mutants=len(items))
            if only is not None:
                chosen = [i for i in items if (i["operator"], i["occurrence"]) in only[module.path]]
            elif sample and sample < len(items):
                chosen = random.Random(seed).sample(items, sample)
            else:
                chosen = items
            for n, item in enumerate(chosen, start=1):
                report.outcomes.append(_run_one(item, tests, workdir, timeout))
                print(
                    f"\r{module.path}: {n}/{len(chosen)} mutants, "
                    f"{report.counts()['killed']} killed",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            print(file=sys.stderr)
            report.seconds = time.perf_counter() - began
            reports.append(report)
            if out is not None:
                with out.open("a") as lines:
                    lines.write(json.dumps(asdict(report)) + "\n")
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=[*GROUPS, "all"], default="all")
    parser.add_argument("--sample", type=int, help="mutants per module, drawn with --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, help="append each module's report here (JSON lines)")
    parser.add_argument(
        "--table", type=Path, help="print the table of a previous run's --out file, run nothing"
    )
    parser.add_argument(
        "--retest",
        type=Path,
        help="run again, on HEAD, only the survivors of a previous run's --out file",
    )
    args = parser.parse_args(argv)
    if args.table is not None:
        lines = args.table.read_text().splitlines()
        return _print_table([_report_from(json.loads(line)) for line in lines if line])
    if shutil.which("cosmic-ray") is None:
        print("cosmic-ray is not installed: pip install -e '.[mutation]'", file=sys.stderr)
        return 2
    names = list(GROUPS) if args.group == "all" else [args.group]
    only = None
    if args.retest is not None:
        only = {}
        for line in args.retest.read_text().splitlines():
            report = _report_from(json.loads(line))
            survivors = {
                (o.operator, o.occurrence) for o in report.outcomes if o.result == "survived"
            }
            only.setdefault(report.module, set()).update(survivors)
    reports = [
        r for n in names for r in run_group(n, args.sample, args.seed, args.timeout, args.out, only)
    ]
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
        return 0
    return _print_table(reports)


def _report_from(fields: dict) -> Report:
    outcomes = [Outcome(**o) for o in fields.pop("outcomes")]
    return Report(**fields, outcomes=outcomes)


def _print_table(reports: list[Report]) -> int:
    print("| group | module | mutants run (of all) | killed | survived | incompetent | killed |")
    print("|---|---|---|---|---|---|---|")
    for r in reports:
        c = r.counts()
        print(
            f"| {r.group} | `{r.module}` | {len(r.outcomes)} (of {r.total_mutants}) | "
            f"{c['killed']} | {c['survived']} | {c['incompetent']} | "
            f"{100 * r.killed_share():.0f} % |"
        )
    for r in reports:
        for o in r.outcomes:
            if o.result == "survived":
                print(f"\nsurvived: {r.module}:{o.line} {o.operator}\n{o.diff}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
