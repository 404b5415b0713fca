"""`model.init_from` judged before launch, in seconds, from the checkpoint's headers alone:
`dstrain check CONFIG`, `dstrain ckpt verify-hf DIR --config C`, and `dstrain train` before it
starts any worker (so a bad checkpoint is one message, once, not a worker's traceback).

Two questions:
- Does the folder fit the architecture? Every file whole, the index right, every tensor there,
  nothing extra, each shape, dtype and FP8 block scale right (`model/hf_verify.py`). This reads
  the safetensors headers and the index, never tensor data.
- What will each rank read? The rank's runtime is built on torch's fake process group, as the dry
  run builds it, and the loader runs on its meta model in counting mode (`read_data=False`):
  the bytes and files of exactly the slices a launch would read. One rank per pipeline position
  by default (ranks that differ only in data- or expert-parallel coordinates read slices of the
  same size); `--rank` picks others.
"""

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dstrain.config.findings import Finding, error, info
from dstrain.config.hf_config import deepseek_notes
from dstrain.config.model_args import ModelArgs
from dstrain.config.schema import DstrainConfig
from dstrain.errors import UserError
from dstrain.model.hf_files import Headers, Problem, read_headers
from dstrain.model.hf_verify import fix_for, summary, verify

KEY = "model.init_from"


@dataclass
class HFCheck:
    folder: str
    files: int
    tensors: int
    checkpoint_bytes: int
    header_seconds: float
    problems: list[Problem]
    notes: list[str]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    headers: Headers | None = None  # what was read, for the ranks' plans; not reported

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "headers"}
        out["problems"] = [asdict(p) for p in self.problems]
        out["ok"] = self.ok
        return out


def check_headers(folder: Path, args: ModelArgs) -> HFCheck:
    """The folder against `args`, from its headers and index."""
    began = time.perf_counter()
    headers = read_headers(folder)
    problems = verify(headers, args)
    return HFCheck(
        folder=str(folder),
        files=len(headers.files),
        tensors=len(headers.tensors),
        checkpoint_bytes=headers.data_bytes,
        header_seconds=time.perf_counter() - began,
        problems=problems,
        notes=deepseek_notes(headers.config),
        headers=headers,
    )


def init_from_findings(
    config: DstrainConfig, args: ModelArgs | None, world_size: int | None
) -> list[Finding]:
    """`model.init_from`'s header check as `check` findings: one error per kind of problem,
    the notes as info; when it fits and the world size is known, what the first and the last
    rank will read (planned on the headers already read). Nothing when init_from is unset or
    its folder has no config.json (a rule says so already)."""
    folder = config.model.init_from
    if folder is None or args is None or not (Path(folder) / "config.json").exists():
        return []
    result = check_headers(Path(folder), args)
    findings = [info(KEY, note) for note in result.notes]
    if result.problems:
        fix = fix_for(result.problems, args)
        by_kind: dict[str, list[Problem]] = {}
        for problem in result.problems:
            by_kind.setdefault(problem.kind, []).append(problem)
        return findings + [
            error(KEY, f"{folder}: {summary(found)}", fix) for found in by_kind.values()
        ]
    findings.append(
        info(
            KEY,
            f"{result.tensors:,} tensors in {result.files} file(s) "
            f"({result.checkpoint_bytes / 2**30:,.1f} GiB) fit the model "
            f"(headers checked in {result.header_seconds:.1f} s)",
        )
    )
    if world_size is None:
        return findings
    _plan_ranks(result, config, world_size, sorted({0, world_size - 1}))
    return findings + [
        info(
            KEY,
            f"rank {r['rank']} of {world_size} will read {_gib(r['bytes'])} from {r['files']} "
            f"file(s), {r['tensors']} slices ({r['bytes'] / max(1, r['share_bytes']):.2f}x "
            "the shards it holds); `dstrain ckpt verify-hf` lists every pipeline position",
        )
        for r in result.ranks
    ]


def refuse_bad_init_from(config: DstrainConfig, args: ModelArgs) -> None:
    """Before `dstrain train` starts any worker: a checkpoint that does not fit is one message
    (a resume, whose checkpoint brings the weights, does not read init_from: not checked)."""
    folder = config.model.init_from
    if folder is None or _resumes(config) or not (Path(folder) / "config.json").exists():
        return
    result = check_headers(Path(folder), args)
    if result.problems:
        raise UserError(
            f"model.init_from: {folder} does not fit this model:\n  {summary(result.problems)}",
            fix_for(result.problems, args),
            exit_code=1,
        )


def _resumes(config: DstrainConfig) -> bool:
    from dstrain.checkpoint.catalog import latest_valid

    how = config.checkpoint.resume
    if how in ("auto", "never"):
        folder = config.run.root / config.run.name / "checkpoints"
        return how == "auto" and folder.is_dir() and latest_valid(folder) is not None
    return True


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def default_ranks(config: DstrainConfig, world_size: int) -> list[int]:
    """The first rank of each pipeline position (pp is the mesh's outermost axis) and the last."""
    pp = max(1, config.parallel.pp)
    per_stage = max(1, world_size // pp)
    return sorted({p * per_stage for p in range(pp)} | {world_size - 1})


def verify_hf(
    folder: Path, config: DstrainConfig, args: ModelArgs, world_size: int, ranks: list[int]
) -> HFCheck:
    """The header check, then each of `ranks`' planned reads (none when the headers fail)."""
    result = check_headers(folder, args)
    if not result.problems:
        planned = config.model_copy(deep=True)
        planned.model.init_from = folder
        _plan_ranks(result, planned, world_size, ranks)
    return result


def _plan_ranks(result: HFCheck, config: DstrainConfig, world_size: int, ranks: list[int]) -> None:
    """Each of `ranks`' reads of `config.model.init_from` (whose headers `result` read), built
    on the fake backend and counted, not read, into `result.ranks`."""
    from dstrain.train.dry_run import dry_run_rank  # torch and the fake backend

    for rank in ranks:
        report = dry_run_rank(
            config, world_size, rank, step=False, read_init_from=False,
            init_from_headers=result.headers,
        )  # fmt: skip
        assert report.init_from is not None
        result.ranks.append(
            {"rank": rank, "coords": report.coords, "stages": report.stages}
            | asdict(report.init_from)
            | {"seconds": report.seconds.get("init_from", 0.0) + report.seconds["build"]}
        )
