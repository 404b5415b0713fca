"""What tokenizing a corpus shows: a live bar on a terminal (bytes read of the corpus, tokens,
tokens/s, ETA) and otherwise a plain line every 30 s, so a cluster log shows the work going on;
always one closing line with the totals and the rate."""

import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

_LINE_EVERY_S = 30.0


class TokenizeProgress:
    """Called with (bytes of text, tokens) after each tokenized batch; `close` prints the totals."""

    def __init__(self, name: str, total_bytes: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.name, self.total_bytes = name, total_bytes
        self.bytes = self.tokens = 0
        self.start = self.last_line = time.perf_counter()
        self.bar = Progress(
            TextColumn("tokenizing"),
            BarColumn(bar_width=24),
            DownloadColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
            transient=True,
        )
        self.task = self.bar.add_task("tokenize", total=max(total_bytes, 1), rate="")
        self.bar.start()

    def __call__(self, num_bytes: int, num_tokens: int) -> None:
        self.bytes += num_bytes
        self.tokens += num_tokens
        now = time.perf_counter()
        rate = f"{self.tokens:,} tokens, {self.tokens / max(now - self.start, 1e-9):,.0f} tok/s"
        self.bar.update(self.task, completed=min(self.bytes, self.total_bytes), rate=rate)
        if self.bar.disable and now - self.last_line >= _LINE_EVERY_S:
            self.last_line = now
            share = self.bytes / max(self.total_bytes, 1)
            self._print(f"tokenizing: {share:.0%} of {self.name}, {rate}")

    def close(self) -> float:
        """Stop the bar, print the totals; the rate in tokens/s."""
        self.bar.stop()
        seconds = max(time.perf_counter() - self.start, 1e-9)
        rate = self.tokens / seconds
        self._print(
            f"tokenized {self.bytes / 2**20:,.1f} MiB into {self.tokens:,} tokens in "
            f"{seconds:,.1f} s ({rate:,.0f} tokens/s)"
        )
        return rate

    def _print(self, message: str) -> None:
        self.console.print(f"dstrain: {message}", markup=False)
        if not self.console.is_terminal:
            sys.stderr.flush()
