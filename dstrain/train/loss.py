"""Cross-entropy for the main head and the MTP heads, normalized once by global token counts, and
the loader's micro-batch layout (`inputs_of`, `labels_of`, and under document masking
`documents_of`, whose boundaries `depth_labels` keeps targets from crossing).

Each micro-batch contributes sum(CE) / (valid tokens of the whole global batch), so gradient
accumulation, data parallelism and pipelining give exactly the loss of one big batch (STYLE 15).
MTP (DeepSeek-V3 eq. 25): lambda / D x sum over depths of that depth's mean CE.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def inputs_of(batch: torch.Tensor) -> torch.Tensor:
    """The model's input tokens of a loader micro-batch [B, S+1]: positions 0..S-1. A token the
    loader stored negative (bitwise not: ~id) is one whose target carries no loss (a prompt's
    token, or a boundary a document mask hides); as an input it is its id."""
    tokens = batch[:, :-1]
    return torch.where(tokens < 0, ~tokens, tokens)


def labels_of(batch: torch.Tensor) -> torch.Tensor:
    """The targets [B, S]: positions 1..S, IGNORE_INDEX where a target carries no loss."""
    targets = batch[:, 1:]
    return torch.where(targets < 0, IGNORE_INDEX, targets)


def next_tokens_of(batch: torch.Tensor) -> torch.Tensor:
    """Token i+1 at position i [B, S-1], as ids (the MTP modules embed them)."""
    return inputs_of(batch)[:, 1:]


def documents_of(batch: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's document in the window [B, S+1] (document masking): the number of EOS
    tokens before it, so an EOS belongs to the document it ends."""
    tokens = torch.where(batch < 0, ~batch, batch)
    ends = (tokens == eos_id).to(torch.int32)
    return ends.cumsum(dim=1, dtype=torch.int32) - ends


def depth_labels(
    labels_BS: torch.Tensor, depth: int, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """The targets of prediction depth `depth` (0: the main head, token i+1 at position i; k:
    MTP depth k, token i+k+1) [B, S-depth]. Under document masking a target in another document
    than its position's carries no loss: nothing before it in its own document was seen."""
    labels = labels_BS[:, depth:]
    if documents is None:
        return labels
    S = labels_BS.size(1)
    crosses = documents[:, depth + 1 : S + 1] != documents[:, : S - depth]
    return labels.masked_fill(crosses, IGNORE_INDEX)


@dataclass(frozen=True)
class TokenCounts:
    """Valid target tokens per depth (index 0: the main head) over the global batch."""

    per_depth: tuple[int, ...]

    @classmethod
    def of(
        cls,
        labels: list[torch.Tensor],
        num_mtp: int,
        documents: list[torch.Tensor] | None = None,
    ) -> "TokenCounts":
        """Counts for this rank's micro-batches (the trainer all-reduces them across ranks);
        `documents` per micro-batch under document masking."""
        docs = documents or [None] * len(labels)
        return cls(
            tuple(
                int(
                    sum(
                        (depth_labels(lab, k, doc) != IGNORE_INDEX).sum().item()
                        for lab, doc in zip(labels, docs, strict=True)
                    )
                )
                for k in range(num_mtp + 1)
            )
        )


def loss_terms(
    outputs: torch.Tensor | tuple[torch.Tensor, ...],
    labels_BS: torch.Tensor,
    counts: TokenCounts,
    mtp_weight: float,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss to back-propagate, detached parts {"main", "mtp"}) for one micro-batch;
    `documents` [B, S+1] under document masking."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
    main = _ce_sum(logits, depth_labels(labels_BS, 0, documents)) / max(counts.per_depth[0], 1)
    parts = {"main": main.detach()}
    total = main
    if not isinstance(outputs, torch.Tensor) and len(outputs) > 1:
        depth = len(outputs) - 1
        mtp = sum(
            _ce_sum(out, depth_labels(labels_BS, k, documents)) / max(counts.per_depth[k], 1)
            for k, out in enumerate(outputs[1:], start=1)
        )
        parts["mtp"] = mtp.detach() / depth
        total = total + mtp_weight / depth * mtp
    return total, parts


def _ce_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    # Upcast bf16/fp16 logits for a stable softmax; fp64 (tests) stays fp64.
    wide = torch.promote_types(logits_BSV.dtype, torch.float32)
    return F.cross_entropy(
        logits_BSV.flatten(0, 1).to(wide),
        labels_BS.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
