"""Validation: the held-out split's loss, every `eval.interval` steps and at the end.

Which rank evaluates what: evaluation k of a run reads the same held-out samples every time,
`eval.steps` batches of `train.global_batch_size` sequences taken in order from the start of the
split; each batch is cut among the data-parallel ranks and into micro-batches exactly as a
training step is (under PP a forward pass through the stages, `parallel/pipeline_eval.py`). The
loss is the sum of the next-token cross-entropy over every target token of all the batches,
summed over the data-parallel ranks, divided once by their count: the same figure in every
layout (to fp32 rounding), and deterministic. Forward only, no gradient; the routers' load
counters are restored afterwards, so evaluation never moves the balancing biases.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from dstrain.config.schema import EvalConfig
from dstrain.data.loader import TokenDataset
from dstrain.model.moe import Router
from dstrain.parallel.context_parallel import ContextShard
from dstrain.parallel.pipeline import Pipeline
from dstrain.parallel.pipeline_eval import forward_only
from dstrain.train.loss import (
    IGNORE_INDEX,
    ce_sum,
    depth_labels,
    documents_of,
    inputs_of,
    labels_of,
)
from dstrain.train.step import DataParallel, autocast, to_device, whole_sequence


@dataclass(frozen=True)
class EvalShape:
    global_batch_size: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int


class Evaluator:
    def __init__(
        self,
        cfg: EvalConfig,
        dataset: TokenDataset,
        shape: EvalShape,
        document_eos: int | None = None,
    ) -> None:
        """`document_eos`: the EOS id under document masking (None: off)."""
        self.cfg, self.dataset, self.shape = cfg, dataset, shape
        self.document_eos = document_eos
        whole = dataset.num_samples // shape.global_batch_size
        self.batches = whole if cfg.steps == 0 else min(cfg.steps, whole)

    def due(self, step: int, last: bool) -> bool:
        return last or step % self.cfg.interval == 0

    @torch.no_grad()
    def run(
        self,
        model: torch.nn.Module,
        pipeline: Pipeline | None,
        dp: DataParallel,
        precision: str,
        context: ContextShard | None = None,
    ) -> dict[str, float]:
        """eval/loss, eval/ppl and eval/tokens over the split's first `batches` batches
        (`context`: this rank's part of each sequence, as the training step cuts it)."""
        device = next(model.parameters()).device
        counters = {
            r: r.tokens_per_expert.clone() for r in model.modules() if isinstance(r, Router)
        }
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # [CE sum, target tokens]
        try:
            for batch in range(self.batches):
                micro = [to_device(mb, device) for mb in self._micro_batches(batch)]
                with autocast(precision, device):
                    totals += (
                        _pipeline_sums(pipeline, micro, device, context)
                        if pipeline is not None
                        else _sums(model, micro, self.document_eos, context)
                    )
        finally:
            model.train(was_training)
            for router, saved in counters.items():
                router.tokens_per_expert.copy_(saved)
        dp.sum(totals)
        loss_sum, tokens = totals.tolist()  # host sync: once per evaluation
        loss = loss_sum / max(tokens, 1.0)
        return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 80.0)), "eval/tokens": tokens}

    def _micro_batches(self, batch: int) -> list[torch.Tensor]:
        """This rank's share of batch `batch`, as a training step would cut it."""
        s = self.shape
        per_rank = s.global_batch_size // s.dp_size
        start = batch * s.global_batch_size + s.dp_rank * per_rank
        rows = [self.dataset[i] for i in range(start, start + per_rank)]
        stacked = torch.from_numpy(np.stack(rows).astype(np.int64))
        return list(stacked.split(s.micro_batch_size))


def _sums(
    model: torch.nn.Module,
    micro: list[torch.Tensor],
    eos: int | None,
    context: ContextShard | None = None,
) -> torch.Tensor:
    out = torch.zeros(2, dtype=torch.float64, device=micro[0].device)
    for mb in micro:
        docs = None if eos is None else documents_of(mb, eos)
        inputs, labels = inputs_of(mb), depth_labels(labels_of(mb), 0, docs)
        if context is not None:
            inputs, labels = context.split(inputs), context.split(labels)
        outputs = model(inputs, **({} if docs is None else {"documents": docs}))
        logits = outputs[0] if isinstance(outputs, tuple) else outputs
        out += _ce_and_count(logits, labels)
    return out


def _ce_and_count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # The training loss's own sum: vocab-parallel where TP leaves the logits a vocabulary shard.
    ce = ce_sum(logits.float(), labels)
    count = (labels != IGNORE_INDEX).sum()
    return torch.stack([ce.double(), count.double()])


def _pipeline_sums(
    pipe: Pipeline,
    micro: list[torch.Tensor],
    device: torch.device,
    context: ContextShard | None = None,
) -> torch.Tensor:
    """The stages' forward pass (`parallel/pipeline_eval.py`); the last stage's rank adds up the
    sums, which reach every pipeline rank. Under context parallelism each rank's part of the
    sequences, and the main head only (no `next_tokens`)."""
    import torch.distributed as dist

    part = context.split if context is not None else whole_sequence
    mtp = getattr(pipe.model, "mtp", None) is not None and context is None
    next_tokens = [inputs_of(mb)[:, 1:] for mb in micro] if mtp else None
    outputs = forward_only(pipe, [part(inputs_of(mb)) for mb in micro], next_tokens)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for out, mb in zip(outputs, micro, strict=False):  # outputs: only on the last stage's rank
        logits = out[0] if isinstance(out, tuple) else out
        totals += _ce_and_count(logits, part(labels_of(mb)))
    dist.all_reduce(totals, group=pipe.group)
    return totals
