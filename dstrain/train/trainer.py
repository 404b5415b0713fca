"""The Trainer: builds everything a run needs (in the order below), then runs the loop.

Every rank builds the same objects; only rank 0 writes metrics, logs and the progress bar.
"""

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from dstrain.checkpoint import store
from dstrain.config.batch import BatchPlan, resolve_batch
from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import to_toml
from dstrain.config.parallel_dims import ParallelDims
from dstrain.config.schema import DstrainConfig
from dstrain.config.validate import raise_if_errors
from dstrain.data.build import build_dataset
from dstrain.data.loader import DataLoader
from dstrain.errors import UserError
from dstrain.metrics.peak import peak_flops
from dstrain.metrics.pipeline_timer import PipelineTimer
from dstrain.metrics.sinks import JsonlSink, Sink, TensorBoardSink
from dstrain.model.flops import param_counts, training_flops_per_token
from dstrain.model.transformer import build_model
from dstrain.parallel.distributed import init_distributed
from dstrain.parallel.expert_parallel import reduce_expert_grads, scale_expert_grads
from dstrain.parallel.mesh import build_meshes
from dstrain.parallel.parallelize import experts_use_fsdp, parallelize_model
from dstrain.parallel.pipeline import Pipeline, build_pipeline
from dstrain.train.faults import fault_from_env
from dstrain.train.loss_scale import LossScaler
from dstrain.train.lr import build_scheduler
from dstrain.train.optim import build_optimizer
from dstrain.train.pipeline_step import pipeline_step
from dstrain.train.progress import TrainProgress, log
from dstrain.train.step import DataParallel, StepResult, train_step


@dataclass
class RunSummary:
    steps: int
    final_loss: float
    tokens_per_s: float
    mfu: float
    peak_rss_mb: float
    wall_s: float
    pipeline_bubble_fraction: float | None = None  # mean over the logged windows


class Trainer:
    def __init__(self, config: DstrainConfig) -> None:
        self.config = config
        self.world = init_distributed(config.comm)
        self.device = self.world.device
        self.run_dir = config.run.root / config.run.name
        self._build_determinism()
        self.model_args = resolve_model_args(config.model)
        self.dims = self._build_dims()
        self.meshes = build_meshes(self.dims, self.device.type) if self.world.backend else None
        self.dp = self._build_data_parallel()
        self.batch = self._build_batch()
        self.tokenizer, self.dataset = build_dataset(
            config.data, vocab_size=self.model_args.vocab_size, seq_len=config.train.seq_len
        )
        self.pipeline: Pipeline | None = None
        self.model = self._build_model()
        self.pipeline_timer = self._build_pipeline_timer()
        self.optimizer = build_optimizer(self.model, config.optim, zero1_group=self._zero1_group())
        self.scheduler = build_scheduler(self.optimizer, config.lr, config.train.steps)
        self.scaler = LossScaler(config.train.loss_scale, config.train.precision == "fp16")
        self.loader = self._build_loader()
        self.step = 0
        self.fault = fault_from_env()
        self._resume()
        self.sinks = self._build_sinks()
        self.flops_per_token = training_flops_per_token(self.model_args, config.train.seq_len)
        self.peak = peak_flops(self.device, config.train.precision)
        self._log_start()

    def _build_determinism(self) -> None:
        torch.manual_seed(self.config.train.seed)
        if self.config.train.deterministic:
            # cuBLAS needs a fixed workspace to be deterministic; set before the first matmul.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # warn_only: an op without a deterministic kernel warns instead of killing the run.
            torch.use_deterministic_algorithms(True, warn_only=True)

    def _build_dims(self) -> ParallelDims:
        p = self.config.parallel
        dims = ParallelDims.of(p, self.world.world_size)
        raise_if_errors(dims.validate())
        if dims.tp > 1 and dims.dp > 1 and p.zero_stage <= 1:
            raise UserError(
                "tp > 1 with data parallelism runs only under FSDP2 here: DDP and ZeRO-1 cannot "
                "reduce tensor-parallel (DTensor) parameters",
                "set parallel.zero_stage = 2 (or 3)",
                exit_code=1,
            )
        if p.zero_stage == 1 and dims.dp > 1 and self.config.checkpoint.enable:
            raise UserError(
                "checkpoints of ZeRO-1 (ZeroRedundancyOptimizer) runs are not supported yet",
                "use parallel.zero_stage = 2 (FSDP2 also shards the optimizer states), or "
                "checkpoint.enable = false",
                exit_code=1,
            )
        return dims

    def _build_data_parallel(self) -> DataParallel:
        if self.meshes is None or self.dims.dp == 1:
            return DataParallel()
        return DataParallel(self.meshes["dp"].get_group(), self.dims.dp)

    def _finish_grads(self) -> None:
        """Each rank's expert gradient is dp x (its ep group's tokens, every tp copy of them):
        summed over the ranks holding the same experts (edp) and divided by dp x tp, it is the
        one-process gradient."""
        if self.dims.ep == 1:
            return
        edp = self.meshes["edp"]
        scale = 1.0 / (self.dims.dp * self.dims.tp)
        if experts_use_fsdp(self.config, self.dims):
            # FSDP already reduce-scattered them as an average over edp: undo the division.
            scale_expert_grads(self.model, edp.size() * scale)
        else:
            reduce_expert_grads(self.model, edp.get_group() if edp.size() > 1 else None, scale)

    def _zero1_group(self):
        if self.config.parallel.zero_stage == 1 and self.dp.size > 1:
            return self.dp.group
        return None

    def _build_batch(self) -> BatchPlan:
        t = self.config.train
        plan, findings = resolve_batch(
            t.micro_batch_size, t.global_batch_size, t.grad_accum_steps, self.dims.dp
        )
        raise_if_errors(findings)
        assert plan is not None
        return plan

    def _build_model(self) -> torch.nn.Module:
        """The module to train, or under PP this rank's stages seen as one module."""
        # Every rank materializes the full model from the same seed, then shards it: identical
        # initial weights to a one-process run (parity), at the cost of one full copy per rank.
        model = build_model(self.model_args, self.device)
        if self.dims.pp == 1:
            return parallelize_model(model, self.config, self.meshes)
        self.pipeline = build_pipeline(
            model, self.config, self.meshes, microbatches=self.batch.grad_accum_steps
        )
        return self.pipeline.model

    def _build_pipeline_timer(self) -> PipelineTimer | None:
        if self.pipeline is None:
            return None
        timer = PipelineTimer(self.pipeline.group)
        timer.instrument(self.pipeline.stages)
        return timer

    def _build_loader(self) -> DataLoader:
        dp_rank = self.meshes["dp"].get_local_rank() if self.dp.size > 1 else 0
        return DataLoader(
            self.dataset,
            global_batch_size=self.batch.global_batch_size,
            micro_batch_size=self.batch.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=self.dims.dp,
            seed=self.config.train.seed,
        )

    def _build_sinks(self) -> list[Sink]:
        if not self.world.is_main:
            return []
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(self._resolved_config()))
        metrics = self.run_dir / "metrics.jsonl"
        _truncate_after(metrics, self.step)
        sinks: list[Sink] = []
        if self.config.metrics.jsonl:
            sinks.append(JsonlSink(metrics))
        if self.config.metrics.tensorboard:
            sinks.append(TensorBoardSink(self.run_dir / "tb"))
        return sinks

    def _resolved_config(self) -> DstrainConfig:
        """The config as it ran: under PP with the micro-batch count the schedule used (what
        `dstrain schedule --from-run` reads)."""
        if self.pipeline is None:
            return self.config
        parallel = self.config.parallel.model_copy(
            update={"num_microbatches": self.batch.grad_accum_steps}
        )
        return self.config.model_copy(update={"parallel": parallel})

    # ---- checkpoints -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything a resume needs: weights (with MoE biases), optimizer, schedule, data
        position, loss scale and RNG."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=_FLAT)
        return {
            "model": model_state,
            "optim": optim_state,
            "train": {
                "layout": self._layout(),
                "step": self.step,
                "lr_last_epoch": self.scheduler.last_epoch,
                "loader": self.loader.state_dict(),
                "scaler": self.scaler.state_dict(),
                "rng": torch.get_rng_state(),
            },
        }

    def save_checkpoint(self) -> Path:
        ckpt = self.config.checkpoint
        return store.save(
            self.run_dir / "checkpoints",
            self.step,
            self.state(),
            keep_last_k=ckpt.keep_last_k,
            is_main=self.world.is_main,
        )

    def _layout(self) -> str:
        d, p = self.dims, self.config.parallel
        return (
            f"dp_replicate={d.dp_replicate},dp_shard={d.dp_shard},cp={d.cp},tp={d.tp},"
            f"pp={d.pp},ep={d.ep},zero_stage={p.zero_stage}"
        )

    def _check_layout(self, path: Path) -> None:
        """Resharding on resume (another layout than the checkpoint's) arrives with the
        fault-tolerance issue; until then it is refused here rather than loaded wrongly."""
        probe = {"train": {"layout": ""}}
        store.load(path, probe)
        saved = probe["train"]["layout"]
        if saved != self._layout():
            raise UserError(
                f"{path} was written under another layout ({saved}) than this run's "
                f"({self._layout()}); resuming with resharding is not built yet",
                "resume with the checkpoint's layout, or start a new run (--set run.name=NEW)",
                exit_code=1,
            )

    def _resume(self) -> None:
        path = self._resume_path()
        if path is None:
            return
        self._check_layout(path)
        state = self.state()
        store.load(path, state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_FLAT,
        )
        train = state["train"]
        self.step = int(train["step"])
        self.scheduler.last_epoch = int(train["lr_last_epoch"])
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]  # type: ignore[attr-defined]
        self.loader.load_state_dict(train["loader"])
        self.scaler.load_state_dict(train["scaler"])
        torch.set_rng_state(train["rng"])
        if self.world.is_main:
            log(f"resumed from {path} at step {self.step}")

    def _resume_path(self) -> Path | None:
        how = self.config.checkpoint.resume
        existing = store.latest(self.run_dir / "checkpoints")
        if how == "never":
            if existing is not None:
                # Saving into it would interleave two runs' step-N folders and prune the new ones.
                raise UserError(
                    f"{self.run_dir} already holds checkpoints of an earlier run (newest "
                    f"{existing.name}); starting over there would mix the two",
                    "give the new run its own --set run.name=NAME, or delete "
                    f"{self.run_dir / 'checkpoints'}",
                    exit_code=1,
                )
            return None
        return existing if how == "auto" else Path(how)

    # ---- the loop ----------------------------------------------------------------------------

    def train(self) -> RunSummary:
        cfg = self.config
        start, started = self.step, time.perf_counter()
        window = _Window()
        last: StepResult | None = None
        with TrainProgress(cfg.train.steps, self.step, enabled=self.world.is_main) as progress:
            while self.step < cfg.train.steps:
                window.start()
                last = self._one_step()
                window.stop(last.tokens)
                progress.advance()
                if self.step % cfg.metrics.log_interval == 0 or self.step == cfg.train.steps:
                    metrics = self._metrics(last, window)
                    for sink in self.sinks:
                        sink.write(self.step, metrics)
                    if self.world.is_main:
                        progress.report(self.step, metrics)
                    window.reset()
                if cfg.checkpoint.enable and self.step % cfg.checkpoint.interval == 0:
                    self.save_checkpoint()
        if cfg.checkpoint.enable and self.step > start and self.step % cfg.checkpoint.interval:
            self.save_checkpoint()
        return self._finish(start, started, last)

    def _one_step(self) -> StepResult:
        t, args = self.config.train, self.model_args
        if self.fault is not None:
            self.fault.maybe_fire(self.world.rank, self.step + 1)
        self.model.train()
        common = dict(
            scaler=self.scaler,
            precision=t.precision,
            grad_clip=t.grad_clip,
            mtp_weight=args.mtp_loss_weight,
            num_mtp=args.num_mtp_modules,
            bias_update_speed=args.bias_update_speed,
            dp=self.dp,
            finish_grads=self._finish_grads,
        )
        if self.pipeline is not None:
            result = pipeline_step(
                self.pipeline,
                self.optimizer,
                self.loader.next_step(),
                num_experts=args.num_routed_experts,
                timer=self.pipeline_timer,
                **common,
            )
        else:
            result = train_step(self.model, self.optimizer, self.loader.next_step(), **common)
        if not result.skipped:
            self.scheduler.step()
        self.step += 1
        return result

    def _metrics(self, result: StepResult, window: "_Window") -> dict[str, float]:
        tokens_per_s = window.tokens / max(window.seconds, 1e-9)
        per_device = tokens_per_s / self.world.world_size
        metrics = {
            "loss/main": result.loss.item(),
            "optim/lr": self.optimizer.param_groups[0]["lr"],
            "optim/grad_norm": result.grad_norm.item(),
            "throughput/tokens_per_s": tokens_per_s,
            "throughput/tokens_per_s_per_device": per_device,
            "time/step_s": window.seconds / max(window.steps, 1),
            "memory/rss_mb": _peak_rss_mb(),
        }
        if result.mtp_loss is not None:
            metrics["loss/mtp"] = result.mtp_loss.item()
        if self.scaler.enabled:
            metrics["optim/loss_scale"] = self.scaler.scale
        if self.peak:
            metrics["throughput/mfu"] = per_device * self.flops_per_token / self.peak
        if self.pipeline_timer is not None:
            p = self.config.parallel
            metrics.update(
                self.pipeline_timer.collect(
                    p.pp_schedule, self.batch.grad_accum_steps, p.num_virtual_stages
                )
            )
        for name, load in result.expert_load.items():
            if load.sum() > 0:
                metrics[f"moe/{name}/max_over_mean"] = (load.max() / load.mean()).item()
        return metrics

    def _finish(self, start: int, started: float, last: StepResult | None) -> RunSummary:
        wall = time.perf_counter() - started
        tokens = (self.step - start) * self.batch.global_batch_size * self.config.train.seq_len
        tokens_per_s = tokens / wall if wall > 0 else 0.0
        summary = RunSummary(
            steps=self.step,
            final_loss=last.loss.item() if last is not None else float("nan"),
            tokens_per_s=tokens_per_s,
            mfu=(
                tokens_per_s * self.flops_per_token / (self.peak * self.world.world_size)
                if self.peak
                else 0.0
            ),
            peak_rss_mb=_peak_rss_mb(),
            wall_s=wall,
            pipeline_bubble_fraction=(
                self.pipeline_timer.mean_bubble() if self.pipeline_timer is not None else None
            ),
        )
        if self.world.is_main:
            summary_path = self.run_dir / "summary.json"
            summary_path.write_text(json.dumps(summary.__dict__, indent=2) + "\n")
        for sink in self.sinks:
            sink.close()
        return summary

    def _log_start(self) -> None:
        if not self.world.is_main:
            return
        counts = param_counts(self.model_args)
        log(f"run directory {self.run_dir} (resolved config in config.toml)")
        log(
            f"model {self.config.model.flavor}: {counts.total / 1e6:.2f}M parameters, "
            f"{counts.activated / 1e6:.2f}M activated per token"
        )
        log(
            f"layout: {self.dims.describe()} on {self.device.type} "
            f"({self.world.backend or 'no process group'}); {self.batch.describe()}, "
            f"seq_len {self.config.train.seq_len}"
        )
        if self.pipeline is not None:
            sizes = ", ".join(str(len(r)) for r in self.pipeline.layers)
            log(
                f"pipeline: {self.config.parallel.pp_schedule}, {self.batch.grad_accum_steps} "
                f"micro-batches; layers per stage [{sizes}] (stage 0 first)"
            )
        log(
            f"data: {self.config.data.source} ({len(self.dataset):,} samples), "
            f"tokenizer {self.tokenizer.name}"
        )


# Optimizer state keyed per parameter name ("param_groups.layers.3.wq.weight.lr"): with nested
# param_groups, DCP keeps one rank's list, which under PP names only that rank's parameters.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class _Window:
    """Wall time and tokens since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds, self.tokens, self.steps = 0.0, 0, 0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, tokens: int) -> None:
        self.seconds += time.perf_counter() - self._t0
        self.tokens += tokens
        self.steps += 1


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _truncate_after(path: Path, step: int) -> None:
    """A resumed run rewrites history from its checkpoint on: drop logged steps after it."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))
