"""How well does `dstrain check` judge real configs? Every sample pasted from a public thread
(tests/fixtures/deepspeed, tests/fixtures/megatron, and ../shared/fixtures/deepspeed when it is
beside the clone) is checked by two source trees in one run: this one and another (`--before
DIR`, e.g. a worktree of an older commit), as a user would run it (`python -m dstrain check FILE
--json` in a fresh process). Per set it prints the samples that run (valid) and the broken ones,
then for each tree:

- false errors: a working sample that gets an error (exit 1), the worse failure;
- caught: a broken sample whose mistake is visible in the file, failed (exit 1) with output that
  names it (a word of its `mention` list);
- noted: a broken sample whose mistake is not visible in the file alone (it depends on the
  launcher, a checkpoint, a second model), exiting 0 with output that names it;
- missed: a broken sample neither caught nor noted; tracebacks are counted apart.

Usage: python benchmarks/check_fixtures.py [--before DIR] [--list]
"""

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "fixtures" / "deepspeed"


@dataclass
class Sample:
    group: str
    path: Path
    broken: bool
    visible: bool
    mention: list[str]
    world_size: int | None
    expect_exit: tuple[int, ...]


def samples() -> list[Sample]:
    out = []
    for group in ("deepspeed", "megatron"):
        folder = REPO / "tests" / "fixtures" / group
        index = yaml.safe_load((folder / "index.yaml").read_text(encoding="utf-8"))
        for s in index["samples"]:
            expect = s["expect"]
            broken = s["file"].startswith("broken/")
            visible = expect.get("visible_in_file", True)
            exits = (expect["exit"],)
            out.append(
                Sample(
                    f"ours/{group}",
                    folder / s["file"],
                    broken,
                    visible,
                    expect.get("mention", []),
                    s.get("world_size"),
                    exits,
                )
            )
    if SHARED.is_dir():
        for path in sorted((SHARED / "valid").glob("*.json")):
            out.append(Sample("shared/deepspeed", path, False, True, [], None, (0,)))
        expect = yaml.safe_load((SHARED / "mistakes" / "expect.yaml").read_text())
        for name, rule in expect.items():
            # expect.yaml allows exit 0 for some (a warning naming the key suffices).
            visible = rule["exit"] != [0, 1] and 0 not in rule["exit"]
            out.append(
                Sample(
                    "shared/deepspeed",
                    SHARED / "mistakes" / name,
                    True,
                    visible,
                    rule["mention"],
                    rule.get("world_size"),
                    tuple(rule["exit"]),
                )
            )
    return out


def judge(root: Path, sample: Sample) -> str:
    cmd = [sys.executable, "-m", "dstrain", "check", str(sample.path), "--json"]
    if sample.world_size:
        cmd += ["--world-size", str(sample.world_size)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
    text = (done.stdout + done.stderr).lower()
    if "traceback" in text:
        return "traceback"
    named = any(word.lower() in text for word in sample.mention)
    if not sample.broken:
        return "ok" if done.returncode == 0 else "false error"
    if 2 in sample.expect_exit:  # unreadable input: exit 2 naming the line
        return "caught" if done.returncode == 2 and named else "missed"
    if sample.visible:
        return "caught" if done.returncode == 1 and named else "missed"
    return "noted" if done.returncode in (0, 1) and named else "missed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another source tree to judge side by side")
    parser.add_argument("--list", action="store_true", help="print every sample's verdicts")
    args = parser.parse_args()
    trees = {"now": REPO} | ({"before": args.before.resolve()} if args.before else {})
    found = samples()
    verdicts = {name: [judge(root, s) for s in found] for name, root in trees.items()}
    groups = sorted({s.group for s in found})
    print("| set | tree | valid | false errors | broken | caught | noted | missed | tracebacks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for group in groups:
        for name in reversed(list(trees)):
            rows = [(s, v) for s, v in zip(found, verdicts[name], strict=True) if s.group == group]
            valid = [v for s, v in rows if not s.broken]
            broken = [v for s, v in rows if s.broken]
            count = [v for _, v in rows]
            print(
                f"| {group} | {name} | {len(valid)} | {valid.count('false error')} | "
                f"{len(broken)} | {broken.count('caught')} | {broken.count('noted')} | "
                f"{broken.count('missed')} | {count.count('traceback')} |"
            )
    if args.list:
        for i, s in enumerate(found):
            row = "  ".join(f"{name}: {verdicts[name][i]:11}" for name in reversed(list(trees)))
            print(f"{s.group:18} {s.path.name:70} {row}")
    summary = {name: dict.fromkeys(set(v), 0) for name, v in verdicts.items()}
    for name, v in verdicts.items():
        for verdict in v:
            summary[name][verdict] += 1
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
