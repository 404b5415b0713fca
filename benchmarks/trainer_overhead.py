"""`dstrain train`'s step time vs a bare training loop over the same model and the same data.

Side by side in one run, on CPU:

- trainer: `Trainer(config).train()` as `dstrain train` runs it (default config: the debug flavor
  with MTP, global batch 16 x seq 128; LR schedule, gradient clipping, balancing-bias update,
  metrics every `metrics.log_interval` steps to JSONL and TensorBoard), in a temporary run
  directory and data cache, checkpoints off;
- bare: written here with no dstrain trainer code: a model built by `build_model` with the same
  seed (checked equal to the trainer's), micro-batches from a `DataLoader` over the trainer's
  dataset (checked by the first step's loss), `model(x)`, `F.cross_entropy` (+ the MTP losses),
  `backward`, `AdamW.step` (same hyper-parameters and decay groups), `zero_grad`.

Interleaving: the trainer's `_one_step` is wrapped so that after every block of N trainer steps
(N = log interval, so each block holds exactly one logging step) a block of N bare steps runs
before the trainer's next step. A trainer block is timed from the start of its first step to the
start of the step after its last, so the logging between steps counts and the bare block does not.
The first block of each is warm-up. Per-step time = block time / N; medians over blocks; the
overhead is trainer / bare - 1 (and the median of the per-pair ratios, which cancels slow drift).

The trainer's stderr goes to /dev/null, so its progress shows as the plain line per log interval
(as under CI or `tee`); in a terminal rich also redraws a live bar, which is not measured here.
One intra-op thread by default: on a shared 2-core machine a second one mostly measures the
neighbours.

Usage: python benchmarks/trainer_overhead.py [--blocks K] [--block N] [--threads T] [--set k=v ...]
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

from dstrain.config.flavors import model_name
from dstrain.config.load import load_config
from dstrain.config.schema import DstrainConfig
from dstrain.data.loader import DataLoader
from dstrain.model.transformer import build_model
from dstrain.train.step import StepResult
from dstrain.train.trainer import Trainer

TARGET = 0.05


def bare_loop(trainer: Trainer) -> tuple[Callable[[], torch.Tensor], torch.nn.Module]:
    """A hand-written step over a fresh model and loader; returns (step -> main loss, model)."""
    cfg: DstrainConfig = trainer.config
    torch.manual_seed(cfg.train.seed)
    model = build_model(trainer.model_args, seed=cfg.train.seed).train()
    loader = DataLoader(
        trainer.dataset,
        global_batch_size=trainer.batch.global_batch_size,
        micro_batch_size=trainer.batch.micro_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=cfg.train.seed,
    )
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": o.weight_decay}, {"params": vectors}],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=0.0,
        foreach=True,
    )
    mtp_weight = trainer.model_args.mtp_loss_weight

    def step() -> torch.Tensor:
        micro_batches = loader.next_step()
        main = torch.zeros(())
        for mb in micro_batches:
            x, y = mb[:, :-1], mb[:, 1:]
            out = model(x)
            logits, *mtp = out if isinstance(out, tuple) else (out,)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            main += loss.detach() / len(micro_batches)
            if mtp:
                extra = sum(
                    F.cross_entropy(out.flatten(0, 1), y[:, k:].flatten())
                    for k, out in enumerate(mtp, start=1)
                )
                loss = loss + mtp_weight / len(mtp) * extra
            (loss / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return main

    return step, model


class Interleaver:
    """Stands in for `trainer._one_step`: times trainer blocks and runs a bare block between."""

    def __init__(
        self, one_step: Callable[[], StepResult], bare_step: Callable[[], torch.Tensor], block: int
    ) -> None:
        self.one_step, self.bare_step, self.block = one_step, bare_step, block
        self.calls = 0
        self.block_start = 0.0
        self.trainer_s: list[float] = []
        self.bare_s: list[float] = []
        self.first_losses: tuple[float, float] | None = None

    def __call__(self) -> StepResult:
        now = time.perf_counter()
        if self.calls == 0:
            self.block_start = now
        elif self.calls % self.block == 0:
            self.trainer_s.append((now - self.block_start) / self.block)
            self.bare_s.append(self._bare_block())
            self.block_start = time.perf_counter()
        self.calls += 1
        result = self.one_step()
        if self.calls == 1:
            self.first_losses = (result.loss.item(), self.bare_step().item())
        return result

    def _bare_block(self) -> float:
        start = time.perf_counter()
        for _ in range(self.block):
            self.bare_step()
        return (time.perf_counter() - start) / self.block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="timed blocks of each (+1 warm-up)")
    parser.add_argument("--block", type=int, help="steps per block (default: log interval)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--set", action="append", default=[], help="config override, k=v")
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run.root={tmp}/runs", f"data.cache_dir={tmp}/cache"]
        overrides += ["checkpoint.enable=false", *args.set]
        config = load_config(None, overrides).config
        block = args.block or config.metrics.log_interval
        # The step that starts after the last block closes it, hence the + 1.
        config.train.steps = block * (args.blocks + 1) + 1
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            trainer = Trainer(config)
            bare_step, bare_model = bare_loop(trainer)
            same = all(
                torch.equal(a, b)
                for a, b in zip(
                    trainer.model.state_dict().values(),
                    bare_model.state_dict().values(),
                    strict=True,
                )
            )
            timer = Interleaver(trainer._one_step, bare_step, block)
            trainer._one_step = timer  # type: ignore[method-assign]
            trainer.train()
        report(config, trainer, timer, same, args.threads)


def report(
    config: DstrainConfig, trainer: Trainer, timer: Interleaver, same: bool, threads: int
) -> None:
    trainer_s, bare_s = timer.trainer_s[1:], timer.bare_s[1:]  # drop the warm-up blocks
    t, b = statistics.median(trainer_s), statistics.median(bare_s)
    paired = statistics.median(x / y for x, y in zip(trainer_s, bare_s, strict=True)) - 1
    loss_t, loss_b = timer.first_losses or (float("nan"), float("nan"))
    m = trainer.model_args
    print(
        f"model {model_name(config.model)} (dim {m.dim}, {m.num_layers} layers, MTP "
        f"{m.num_mtp_modules}), {trainer.batch.describe()}, seq {config.train.seq_len}, "
        f"{config.train.precision}, {threads} threads"
    )
    print(
        f"sanity: same initial weights {'yes' if same else 'NO'}; first-step loss "
        f"trainer {loss_t:.5f}, bare {loss_b:.5f}"
    )
    print(
        f"{len(trainer_s)} interleaved blocks of {timer.block} steps each (log interval "
        f"{config.metrics.log_interval}, jsonl {config.metrics.jsonl}, "
        f"tensorboard {config.metrics.tensorboard}), median per step:"
    )
    print(f"  bare loop   {b * 1000:8.1f} ms")
    print(f"  trainer     {t * 1000:8.1f} ms")
    verdict = "ok" if t / b - 1 <= TARGET else f"above the {TARGET:.0%} target"
    print(
        f"  overhead    {100 * (t / b - 1):+7.1f} %   (median of paired blocks "
        f"{100 * paired:+.1f} %)  {verdict}"
    )


if __name__ == "__main__":
    main()
