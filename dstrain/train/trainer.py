"""The Trainer: builds everything a run needs (in the order below), then runs the loop.

Every rank builds the same objects; only rank 0 writes metrics, logs and the progress bar.
"""

import contextlib
import os
import time
from typing import Any

import torch

from dstrain import __version__
from dstrain.checkpoint.catalog import latest_valid
from dstrain.config.flavors import model_name, resolve_model_args
from dstrain.config.load import to_toml
from dstrain.config.schema import DstrainConfig
from dstrain.data.build import build_dataset, split_eval
from dstrain.data.loader import DataLoader, TokenDataset
from dstrain.data.tokenizer import Tokenizer
from dstrain.errors import UserError
from dstrain.metrics.peak import forget, peak_flops
from dstrain.metrics.processor import (
    MetricsProcessor,
    Throughput,
    Window,
    peak_rss_mb,
)
from dstrain.metrics.sinks import Sink
from dstrain.model.flops import param_counts, training_flops_per_token
from dstrain.parallel.context_parallel import context_shard
from dstrain.parallel.distributed import env_int, init_distributed
from dstrain.parallel.expert_parallel import reduce_expert_grads, scale_expert_grads
from dstrain.parallel.moe_tokens import expert_grad_scale, reduce_split_grads
from dstrain.parallel.once import once_per_cache
from dstrain.parallel.parallelize import experts_use_fsdp
from dstrain.train.checkpointing import CpuRng, SchedulePosition, TrainCheckpoints
from dstrain.train.evaluation import EvalShape, Evaluator
from dstrain.train.faults import fault_from_env, poisoned_forward
from dstrain.train.goodput import RunClock
from dstrain.train.guard import NumericsGuard
from dstrain.train.heartbeat import Heartbeat, explain_timeout, read_heartbeats
from dstrain.train.loss_scale import LossScaler
from dstrain.train.lr import build_scheduler
from dstrain.train.observe import build_pipeline_timer, build_probes, build_sinks, step_figures
from dstrain.train.oom import is_out_of_memory, out_of_memory
from dstrain.train.pipeline_step import pipeline_step
from dstrain.train.precision import configure_precision
from dstrain.train.preemption import Preemption
from dstrain.train.profiling import StepProfiler
from dstrain.train.progress import TrainProgress, log
from dstrain.train.runtime import build_runtime
from dstrain.train.step import StepResult, train_step
from dstrain.train.summary import RunSummary, write_summary


class Trainer:
    def __init__(self, config: DstrainConfig) -> None:
        self.config = config
        self.world = init_distributed(config.comm)
        self.device = self.world.device
        self.run_dir = config.run.root / config.run.name
        self._build_determinism()
        self.precision = configure_precision(
            config.train.precision,
            config.train.tf32,
            self.device,
            resolve_model_args(config.model),
            config.train.fp8_backend,
        )
        runtime = build_runtime(config, self.world, init_from=not self._will_resume())
        self.model_args, self.dims, self.meshes = runtime.model_args, runtime.dims, runtime.meshes
        self.dp, self.batch = runtime.dp, runtime.batch
        self.context = context_shard(self.meshes)  # this rank's part of each sequence (cp)
        self.model, self.pipeline = runtime.model, runtime.pipeline
        self.optimizer = runtime.optimizer
        self.init_from = runtime.weights  # None: drawn (or resumed)
        self.tokenizer, self.dataset, held_out = once_per_cache(
            self.world, config.data.cache_scope, self._load_data
        )
        self.probes = build_probes(config, self.device, self.meshes, self.model, self.pipeline)
        self.pipeline_timer = build_pipeline_timer(self.pipeline, self.probes, self.device)
        self.scheduler = build_scheduler(self.optimizer, config.lr, config.train.steps)
        self.scaler = LossScaler(config.train.loss_scale, config.train.precision == "fp16")
        self.loader = self._build_loader()
        self.evaluator = self._build_evaluator(held_out)
        self.step = 0
        self.fault = fault_from_env()
        self.guard = NumericsGuard(config.guard, fp16=config.train.precision == "fp16")
        self.clock = RunClock(self.run_dir, self.world.is_main, config.checkpoint.resume == "never")
        self.checkpoints = self._build_checkpoints()
        self._resume()
        self.heartbeat = Heartbeat(
            self.run_dir, self.world.rank, env_int("TORCHELASTIC_RESTART_COUNT", 0)
        )
        self.preemption = Preemption(config.checkpoint.preemption_deadline_s)
        self.preempted, self._last_save_s = False, 0.0
        self.sinks = self._build_sinks()
        self.flops_per_token = training_flops_per_token(self.model_args, config.train.seq_len)
        self.peak = peak_flops(self.device, self.precision.peak_kind)
        self.metrics = MetricsProcessor(
            self.model,
            Throughput(self.world.world_size, self.flops_per_token, self.peak.flops),
            self.probes,
            self.device,
            self.optimizer,
        )
        self.profiler = StepProfiler(
            config.metrics.profile_steps, self.run_dir / "profile", self.world.rank, self.device
        )
        self._log_start()

    def _will_resume(self) -> bool:
        """A checkpoint will bring the weights: then `model.init_from` is not read."""
        how = self.config.checkpoint.resume
        if how == "never":
            return False
        if how != "auto":
            return True
        return latest_valid(self.run_dir / "checkpoints") is not None

    def _build_determinism(self) -> None:
        torch.manual_seed(self.config.train.seed)
        if self.config.train.deterministic:
            # cuBLAS needs a fixed workspace to be deterministic; set before the first matmul.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # warn_only: an op without a deterministic kernel warns instead of killing the run.
            torch.use_deterministic_algorithms(True, warn_only=True)

    def _finish_grads(self) -> None:
        """Each rank's expert gradient is dp x cp x (its ep group's tokens, and every tp copy of
        them under moe_tp = repeat): summed over the ranks holding the same experts (edp) and
        divided by dp x cp (x tp), it is the one-process gradient. Under moe_tp = split_tokens
        the routers' (and unsharded experts') gradients hold each tp rank's rows only: summed
        over tp."""
        if self.dims.tp > 1 and self.config.parallel.moe_tp == "split_tokens":
            reduce_split_grads(self.model, self.meshes["tp"].get_group())
        if self.dims.ep == 1:
            return
        edp = self.meshes["edp"]
        # The loss was multiplied by the ranks with their own targets: dp, times cp.
        dp = self.dims.dp * self.dims.cp
        scale = expert_grad_scale(dp, self.dims.tp, self.config.parallel.moe_tp)
        if experts_use_fsdp(self.config, self.dims):
            # FSDP already reduce-scattered them as an average over edp: undo the division.
            scale_expert_grads(self.model, edp.size() * scale)
        else:
            reduce_expert_grads(self.model, edp.get_group() if edp.size() > 1 else None, scale)

    def _load_data(self) -> tuple[Tokenizer, TokenDataset, TokenDataset | None]:
        """(tokenizer, training samples, held-out samples or None), tokenized on first use."""
        config = self.config
        tokenizer, dataset = build_dataset(
            config.data, vocab_size=self.model_args.vocab_size, seq_len=config.train.seq_len
        )
        dataset, held_out = split_eval(
            config.eval, config.data, tokenizer, dataset, self.batch.global_batch_size
        )
        return tokenizer, dataset, held_out

    def _build_evaluator(self, held_out: TokenDataset | None) -> Evaluator | None:
        if held_out is None:
            return None
        dp_rank = self.meshes["dp"].get_local_rank() if self.dp.size > 1 else 0
        shape = EvalShape(
            self.batch.global_batch_size, self.batch.micro_batch_size, dp_rank, self.dims.dp
        )
        eos = self.tokenizer.eos_id if self.config.data.document_mask else None
        return Evaluator(self.config.eval, held_out, shape, eos)

    def _build_loader(self) -> DataLoader:
        dp_rank = self.meshes["dp"].get_local_rank() if self.dp.size > 1 else 0
        return DataLoader(
            self.dataset,
            global_batch_size=self.batch.global_batch_size,
            micro_batch_size=self.batch.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=self.dims.dp,
            seed=self.config.train.seed,
            pin_memory=self.device.type == "cuda",
        )

    def _build_sinks(self) -> list[Sink]:
        resolved = self._resolved_config()
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(resolved))
        return build_sinks(
            self.config,
            self.run_dir,
            rank=self.world.rank,
            local_rank=env_int("LOCAL_RANK", 0),
            is_main=self.world.is_main,
            after_step=self.step,
            resolved=resolved.model_dump(mode="json"),
        )

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

    def _build_checkpoints(self) -> TrainCheckpoints:
        """What travels with the weights: schedule, data position, loss scale, guard, RNG, and
        the step and productive time (goodput forgets the time of steps a resume recomputes)."""
        stateful = {
            "counters": _Counters(self),
            "scheduler": SchedulePosition(self.scheduler),
            "loader": self.loader,
            "scaler": self.scaler,
            "guard": self.guard,
            "rng": CpuRng(),
        }
        return TrainCheckpoints(
            self.run_dir / "checkpoints",
            self.config.checkpoint,
            self.model,
            self.optimizer,
            stateful,
            self.world.is_main,
        )

    def save_checkpoint(self, kind: str = "full") -> None:
        self.heartbeat.beat(self.step, "checkpoint")
        with self.probes.phase("checkpoint"), self.probes.quiet():
            self.checkpoints.save(self.step, self._meta(), kind)

    def _meta(self) -> dict[str, Any]:
        """What `dstrain ckpt inspect/diff` and a resume read without loading tensors."""
        d, p = self.dims, self.config.parallel
        layout = {a: getattr(d, a) for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
        layout |= {
            "zero_stage": p.zero_stage,
            "pp_schedule": p.pp_schedule,
            "num_virtual_stages": p.num_virtual_stages,
        }
        return {
            "tokens_seen": self.step * self.batch.global_batch_size * self.config.train.seq_len,
            "world_size": self.world.world_size,
            "layout": layout,
            "model": self.model_args.model_dump(mode="json"),
            "optimizer": self.config.optim.name,
            "dstrain_version": __version__,
            "init_from": str(self.config.model.init_from or ""),
        }

    def _resume(self) -> None:
        """Auto-resume (or --resume PATH): the newest valid checkpoint, resharded to this layout
        when it was written under another one."""
        done_before = max((b["step"] for b in read_heartbeats(self.run_dir)), default=0)
        resumed = self.checkpoints.resume(
            self.config.checkpoint.resume,
            self.model_args.model_dump(mode="json"),
            self.config.optim.name,
        )
        if resumed is None:
            return
        path, saved_layout = resumed
        lost = self.clock.resumed(self.step, done_before)
        if self.world.is_main:
            now = self._meta()["layout"]
            changed = [
                f"{k} {saved_layout[k]} -> {v}"
                for k, v in now.items()
                if saved_layout.get(k, v) != v
            ]
            log(
                f"resumed from {path} at step {self.step}"
                + (f"; resharded ({', '.join(changed)})" if changed else "")
                + (f"; {lost} step(s) after it are recomputed" if lost else "")
            )

    def _rollback(self, reason: str) -> bool:
        """guard.policy = rollback: back to the newest checkpoint (weights, optimizer, schedule,
        loss scale); the data position moves on, past the bad batch."""
        self.checkpoints.wait()
        path = self.checkpoints.newest_valid()
        if path is None:
            if self.world.is_main:
                log(f"numerics guard: {reason}; no checkpoint to roll back to, step skipped")
            return False
        before = self.step
        self.checkpoints.load(path, restore=("counters", "scheduler", "scaler"))
        self.clock.resumed(self.step, before)
        for sink in self.sinks:
            sink.rewind(self.step)
        if self.world.is_main:
            log(f"numerics guard: {reason}; rolled back from step {before} to {path.name}")
        return True

    # ---- the loop ----------------------------------------------------------------------------

    def train(self) -> RunSummary:
        cfg = self.config
        start, started = self.step, time.perf_counter()
        window = Window()
        last: StepResult | None = None
        with TrainProgress(cfg.train.steps, self.step, enabled=self.world.is_main) as progress:
            while self.step < cfg.train.steps:
                self.heartbeat.beat(self.step, "step")
                window.start()
                with self.profiler.step(self.step + 1):
                    last = self._guarded_step()
                seconds = window.stop(last.tokens)
                self._note_trace()
                if not last.skipped:
                    self.clock.add(seconds)
                elif self.guard.last_reason is not None and self._on_bad_step():
                    continue  # rolled back: the loop resumes at the checkpoint's step
                progress.advance()
                evaluation = self._maybe_evaluate()
                if self.step % cfg.metrics.log_interval == 0 or self.step == cfg.train.steps:
                    self._log_metrics(last, window, progress, evaluation)
                elif evaluation:
                    self._write(evaluation, progress)
                self._maybe_save()
                if self.preemption.agreed(last.preempted):
                    self._preempt()
                    break
        unsaved = self.step > start and self.step % cfg.checkpoint.interval
        if cfg.checkpoint.enable and unsaved and not self.preempted:
            self.save_checkpoint()
        return self._finish(start, started, last)

    def _guarded_step(self) -> StepResult:
        """One step; a collective that times out becomes one error naming the rank that stopped
        answering (from the heartbeats) and what this rank was doing; running out of memory,
        the advice of `train/oom.py`."""
        try:
            return self._one_step()
        except (RuntimeError, UserError, MemoryError) as exc:
            if is_out_of_memory(exc):
                raise out_of_memory(self, exc) from None
            explained = explain_timeout(exc, self.run_dir, self.world.rank, self.step + 1)
            if explained is None:
                raise
            self.heartbeat.beat(self.step, "failed")
            # The other rank may have left on purpose (out of memory) after its shards of an
            # async save were written: this rank publishes it rather than dropping it.
            self.checkpoints.writer.finish_alone(self.config.comm.timeout_s)
            raise explained from exc

    def _on_bad_step(self) -> bool:
        """The guard refused the update: skip it, or roll back (True)."""
        reason = self.guard.last_reason
        if self.config.guard.policy == "rollback":
            return self._rollback(reason)
        if self.world.is_main:
            log(f"numerics guard: {reason}; step {self.step} skipped (its batch is dropped)")
        return False

    def _note_trace(self) -> None:
        path, self.profiler.written = self.profiler.written, None
        if path is not None and self.world.is_main:
            log(f"profiler trace of steps {self.config.metrics.profile_steps} -> {path.parent}")

    def _maybe_evaluate(self) -> dict[str, float]:
        """The validation figures when this step is an evaluation step, else nothing."""
        last = self.step == self.config.train.steps
        if self.evaluator is None or not self.evaluator.due(self.step, last):
            return {}
        self.heartbeat.beat(self.step, "compute")
        with self.probes.quiet():
            return self.evaluator.run(
                self.model, self.pipeline, self.dp, self.config.train.precision, self.context
            )

    def _write(self, metrics: dict[str, float], progress: TrainProgress) -> None:
        for sink in self.sinks:
            sink.write(self.step, metrics)
        if self.world.is_main:
            progress.report(self.step, metrics)

    def _log_metrics(
        self,
        last: StepResult,
        window: Window,
        progress: TrainProgress,
        evaluation: dict[str, float] | None = None,
    ) -> None:
        metrics = self.metrics.collect(step_figures(last, self.optimizer, self.scaler), window)
        metrics.update(evaluation or {})
        metrics["guard/bad_steps"] = float(self.guard.events)
        if self.pipeline_timer is not None:
            p = self.config.parallel
            with self.probes.quiet():
                bubble = self.pipeline_timer.collect(
                    p.pp_schedule, self.batch.grad_accum_steps, p.num_virtual_stages
                )
            metrics.update(bubble)
        self._write(metrics, progress)
        window.reset()

    def _maybe_save(self) -> None:
        ckpt = self.config.checkpoint
        if not ckpt.enable:
            return
        if self.step % ckpt.interval == 0:
            self.save_checkpoint()
        elif ckpt.model_only_interval and self.step % ckpt.model_only_interval == 0:
            self.save_checkpoint("model")
        with self.probes.phase("checkpoint"), self.probes.quiet():
            self.checkpoints.poll()

    def _preempt(self) -> None:
        """SIGTERM: a final checkpoint if the deadline leaves time for one, then a clean exit."""
        self.preempted = True
        enough = self.preemption.seconds_left() > 2 * self._last_save_s
        if self.config.checkpoint.enable and enough:
            began = time.perf_counter()
            self.save_checkpoint()
            self.checkpoints.wait()
            self._last_save_s = time.perf_counter() - began
        if self.world.is_main:
            saved = "final checkpoint saved" if enough else "no time left for a checkpoint"
            log(f"preempted (SIGTERM) after step {self.step}: {saved}")

    def _one_step(self) -> StepResult:
        t, args = self.config.train, self.model_args
        if self.fault is not None:
            self.fault.maybe_fire(self.world.rank, self.step + 1)
        self.guard.last_reason = None  # set only if the guard refuses this step
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
            guard=self.guard.allow,
            probes=self.probes,
            preempting=self.preemption.signalled,
        )
        self.heartbeat.beat(self.step, "data")
        with self.probes.phase("data"):
            batch = self.loader.next_step()
        self.heartbeat.beat(self.step, "compute")
        with self._faulty_forward():
            result = self._run_step(batch, common)
        if not result.skipped:
            self.scheduler.step()
        self.step += 1
        return result

    def _run_step(self, batch: list[torch.Tensor], common: dict[str, Any]) -> StepResult:
        if self.pipeline is not None:
            return pipeline_step(
                self.pipeline,
                self.optimizer,
                batch,
                num_experts=self.model_args.num_routed_experts,
                timer=self.pipeline_timer,
                **common,
            )
        eos = self.tokenizer.eos_id if self.config.data.document_mask else None
        return train_step(
            self.model, self.optimizer, batch, document_eos=eos, context=self.context, **common
        )

    def _faulty_forward(self) -> contextlib.AbstractContextManager:
        """DSTRAIN_INJECT_FAULT=nan: this rank's forward gives NaN during this step."""
        fault = self.fault
        if (
            fault is not None
            and fault.kind == "nan"
            and fault.fires(self.world.rank, self.step + 1)
        ):
            return poisoned_forward(self.model)
        return contextlib.nullcontext()

    def _finish(self, start: int, started: float, last: StepResult | None) -> RunSummary:
        self.checkpoints.close()
        self.profiler.finish()
        self._note_trace()
        if self.probes.comm is not None:
            self.probes.comm.stop()
        self.heartbeat.beat(self.step, "done")
        self.heartbeat.close()
        wall = time.perf_counter() - started
        tokens = (self.step - start) * self.batch.global_batch_size * self.config.train.seq_len
        tokens_per_s = tokens / wall if wall > 0 else 0.0
        per_device = tokens_per_s * self.flops_per_token / self.world.world_size
        peaks = self.metrics.run_peaks
        summary = RunSummary(
            steps=self.step,
            world_size=self.world.world_size,
            device=_device_name(self.device),
            final_loss=last.loss.item() if last is not None else float("nan"),
            tokens_per_s=tokens_per_s,
            tflops_per_device=per_device / 1e12,
            mfu=self._mfu(per_device),
            mfu_against=self.peak.source,
            comm_exposed_fraction=self.metrics.mean_comm_fraction(),
            pipeline_bubble_fraction=(
                self.pipeline_timer.mean_bubble() if self.pipeline_timer is not None else None
            ),
            peak_rss_mb=peaks.get("memory/peak_rss_mb", peak_rss_mb()),
            peak_gpu_allocated_mb=peaks.get("memory/peak_allocated_mb"),
            wall_s=wall,
            bad_steps=self.guard.events,
            checkpoint_failures=self.checkpoints.failures,
            preempted=self.preempted,
            **self.clock.summary(),
        )
        if self.world.is_main:
            write_summary(self.run_dir / "summary.json", summary)
        for sink in self.sinks:
            sink.close()
        return summary

    def _mfu(self, flops_per_device: float) -> float:
        """The run's MFU; above 100 % the CPU peak was measured on a busy machine: forgotten, so
        the next run measures it again."""
        mfu = flops_per_device / self.peak.flops if self.peak.flops else 0.0
        if mfu > 1.0 and self.device.type == "cpu":
            forget(self.precision.peak_kind)
            if self.world.is_main:
                log(
                    f"MFU {100 * mfu:.0f}% is above this CPU's cached matmul peak, which was "
                    "measured while other work ran: it is measured again next run"
                )
        return mfu

    def _log_start(self) -> None:
        if not self.world.is_main:
            return
        counts = param_counts(self.model_args)
        log(f"run directory {self.run_dir} (resolved config in config.toml)")
        log(
            f"model {model_name(self.config.model)}: {counts.total / 1e6:.2f}M parameters, "
            f"{counts.activated / 1e6:.2f}M activated per token"
        )
        if self.init_from is not None:
            log(
                f"initial weights: {self.init_from.folder} ({len(self.init_from.tensors)} "
                f"tensors; this rank read {self.init_from.bytes_read / 2**20:,.1f} of "
                f"{self.init_from.total_bytes / 2**20:,.1f} MB, its slices; the optimizer "
                "starts fresh)"
            )
        log(f"precision: {self.precision.describe()}; MFU against {self.peak.source}")
        if self.precision.warning:
            log(f"warning: {self.precision.warning}")
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
        held = (
            ""
            if self.evaluator is None
            else (f", {self.evaluator.dataset.num_samples:,} held out for validation")
        )
        masking = ", document masking" if self.config.data.document_mask else ""
        log(
            f"data: {self.config.data.source} ({len(self.dataset):,} samples{held}), "
            f"tokenizer {self.tokenizer.name}{masking}"
        )
        m = self.config.metrics
        if m.prometheus_port is not None:
            log(
                f"Prometheus: http://{m.prometheus_host}:{m.prometheus_port}/metrics "
                "(rank r on this port + its local rank)"
            )


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class _Counters:
    """The trainer's step and productive time, as a checkpointed object."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.trainer.step, "productive_s": self.trainer.clock.productive_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.step = int(state["step"])
        self.trainer.clock.productive_s = float(state["productive_s"])
