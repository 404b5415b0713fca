"""The resumable loader: one global sample order, cut into per-rank micro-batches.

Which rank receives what: optimizer step s consumes the global positions
`[p, p + global_batch_size)` where p is the loader's `sample_position` (s * global_batch_size for an
uninterrupted run). Data-parallel rank r takes the contiguous slice
`[p + r * per_rank, p + (r + 1) * per_rank)`, per_rank = global_batch_size // dp_size, as
micro-batches of `micro_batch_size` in that order. Position q is sample
`permutation(seed + q // num_samples)[q % num_samples]`: a fresh shuffle every epoch.

The state is that global position alone (plus what checks it still means the same thing), so a
checkpoint written with dp=4 resumes exactly under dp=2: rank-major concatenation of a step's
micro-batches does not depend on dp_size or micro_batch_size.
"""

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from dstrain.data.shards import Shards
from dstrain.errors import UserError


class TokenDataset:
    """Sample i is the `seq_len + 1` tokens starting at `i * seq_len` of the flat stream.

    Consecutive samples overlap by one token, so every token but the first is a target exactly
    once per epoch (inputs `[:-1]`, targets `[1:]`).
    """

    def __init__(
        self, shards: Shards, seq_len: int, first: int = 0, count: int | None = None
    ) -> None:
        """Samples `[first, first + count)` of the stream's windows (all by default: a held-out
        split takes a range of them)."""
        if seq_len < 1:
            raise UserError(f"seq_len must be at least 1, got {seq_len}", exit_code=1)
        self.shards = shards
        self.seq_len = seq_len
        self.first = first
        available = (shards.total_tokens - 1) // seq_len
        self.num_samples = available - first if count is None else count
        if self.num_samples < 1:
            raise UserError(
                f"the corpus has {shards.total_tokens} tokens; one sample of "
                f"train.seq_len={seq_len} needs {seq_len + 1}",
                fix=f"use more data or --set train.seq_len={max(1, shards.total_tokens - 1)}",
                exit_code=1,
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """The window's tokens; where a token carries no loss as a target (instruction data:
        the prompts), stored as ~id (negative), which `train/loss.py` decodes."""
        index += self.first
        start, stop = index * self.seq_len, (index + 1) * self.seq_len + 1
        tokens = self.shards.read(start, stop)
        mask = self.shards.read_mask(start, stop)
        if mask is None:
            return tokens
        tokens = tokens.astype(np.int64)
        return np.where(mask.astype(bool), tokens, ~tokens)


@lru_cache(maxsize=4)
def _permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    # Cached: a step touches one epoch (two at a boundary); a permutation of millions of samples
    # costs tens of milliseconds, too much to redo every step.
    order = np.random.default_rng(seed + epoch).permutation(num_samples)
    order.flags.writeable = False
    return order


def sample_order(start: int, count: int, *, num_samples: int, seed: int) -> np.ndarray:
    """The sample indices at global positions `[start, start + count)`, across epochs."""
    out = np.empty(count, dtype=np.int64)
    position, filled = start, 0
    while filled < count:
        epoch, offset = divmod(position, num_samples)
        take = min(count - filled, num_samples - offset)
        out[filled : filled + take] = _permutation(num_samples, seed, epoch)[offset : offset + take]
        position, filled = position + take, filled + take
    return out


class DataLoader:
    """This rank's micro-batches, step by step; see the module docstring for who gets what."""

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        pin_memory: bool = False,
    ) -> None:
        """`pin_memory`: micro-batches in page-locked host memory, for one non-blocking copy to
        an accelerator each."""
        _check_batch(global_batch_size, micro_batch_size, dp_rank, dp_size, seed)
        self.pin_memory = pin_memory
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.per_rank = global_batch_size // dp_size
        self.sample_position = 0

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (0-based)."""
        return self.sample_position // self.dataset.num_samples

    def order(self, position: int) -> int:
        """The sample index at a global position (any position, also beyond one epoch)."""
        return int(
            sample_order(position, 1, num_samples=self.dataset.num_samples, seed=self.seed)[0]
        )

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches for the next optimizer step: `per_rank // micro_batch_size`
        LongTensors of shape [micro_batch_size, seq_len + 1]."""
        start = self.sample_position + self.dp_rank * self.per_rank
        indices = sample_order(
            start, self.per_rank, num_samples=self.dataset.num_samples, seed=self.seed
        )
        self.sample_position += self.global_batch_size
        size = self.micro_batch_size
        return [self._gather(indices[i : i + size]) for i in range(0, self.per_rank, size)]

    def _gather(self, indices: np.ndarray) -> torch.Tensor:
        batch = np.empty((len(indices), self.dataset.seq_len + 1), dtype=np.int64)
        for row, index in enumerate(indices.tolist()):
            batch[row] = self.dataset[index]  # casts uint16/uint32 -> int64 in the copy
        tensor = torch.from_numpy(batch)
        return tensor.pin_memory() if self.pin_memory else tensor

    def state_dict(self) -> dict[str, Any]:
        """Global, rank-independent state: identical on every rank."""
        return {
            "sample_position": self.sample_position,
            "seed": self.seed,
            "num_samples": self.dataset.num_samples,
            "seq_len": self.dataset.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; dp_size, dp_rank and the batch sizes may differ from the saved
        run, but the data, seq_len and seed must not (positions would mean other samples)."""
        current = self.state_dict()
        for key in ("seed", "num_samples", "seq_len"):
            if key in state and state[key] != current[key]:
                raise UserError(
                    f"the checkpoint's data loader has {key}={state[key]}, this run has "
                    f"{current[key]}: its sample position would point at other samples",
                    fix="resume with the same data source, train.seq_len and seed as the "
                    "checkpoint, or start a fresh run",
                    exit_code=1,
                )
        self.sample_position = int(state["sample_position"])


def _check_batch(
    global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int
) -> None:
    if min(global_batch_size, micro_batch_size, dp_size) < 1 or not 0 <= dp_rank < dp_size:
        raise UserError(
            f"invalid batch layout: global_batch_size={global_batch_size}, "
            f"micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}",
            fix="batch sizes and dp_size must be >= 1 and 0 <= dp_rank < dp_size",
            exit_code=1,
        )
    if global_batch_size % dp_size:
        raise UserError(
            f"global_batch_size={global_batch_size} is not divisible by the data-parallel size "
            f"{dp_size}",
            fix=f"use a multiple of {dp_size} for train.global_batch_size",
            exit_code=1,
        )
    per_rank = global_batch_size // dp_size
    if per_rank % micro_batch_size:
        raise UserError(
            f"each data-parallel rank gets {per_rank} samples per step, not divisible by "
            f"micro_batch_size={micro_batch_size}",
            fix="use a micro_batch_size that divides global_batch_size / dp",
            exit_code=1,
        )
    if seed < 0:
        raise UserError(f"seed must be >= 0 for the data order, got {seed}", exit_code=1)
