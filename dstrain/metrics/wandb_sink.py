"""Weights & Biases, offline only: the run is written under `folder/wandb/offline-run-*/` and
never sent anywhere (training machines often have no network). Upload it later from a machine
that has one with `wandb sync FOLDER/wandb/offline-run-*`.

Scalars are logged at their training step. `moe/<layer>/tokens_per_expert` becomes a
`wandb.Histogram` with one bin per expert (bin i holds expert i's token count), which W&B draws as
the expert-load heatmap over steps; a layer with more experts than W&B's 512-bin limit is skipped.
"""

import os
from pathlib import Path
from typing import Any

from dstrain.errors import UserError
from dstrain.metrics.sinks import Metrics

MAX_BINS = 512  # wandb.Histogram refuses more

# Nothing on the terminal (the trainer owns it), and no probing of git, the machine or the
# network. `wandb.setup` makes the process-wide settings offline too: otherwise wandb's own usage
# telemetry, which reads those and not the run's, posts to its server at exit.
_OFFLINE = dict(
    mode="offline",
    silent=True,
    console="off",
    disable_git=True,
    disable_code=True,
    save_code=False,
    x_disable_stats=True,
    x_disable_meta=True,
    x_disable_machine_info=True,
    x_save_requirements=False,
    # Generous start-up waits: on a loaded node (a 2-core CI machine running other ranks) the
    # wandb-core service can take longer to start than the defaults (30 s, 90 s) allow.
    x_service_wait=300.0,
    init_timeout=300.0,
)


class WandbSink:
    open_runs = 0  # sinks in this process whose run is not finished yet

    def __init__(self, folder: Path, *, run: str, config: dict[str, Any]) -> None:
        try:
            import wandb  # about 0.7 s: only when this sink is used
        except ImportError:
            raise UserError(
                "metrics.wandb is on but the `wandb` package is not installed",
                "pip install wandb, or set metrics.wandb=false",
                exit_code=1,
            ) from None
        self.wandb = wandb
        _drop_inherited_service()
        settings = wandb.Settings(**_OFFLINE)
        wandb.setup(settings=settings)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            mode="offline",
            dir=str(folder),
            name=run,
            config=config,
            reinit="create_new",  # several sinks (tests, a CLI session) may live in one process
            settings=settings,
        )
        WandbSink.open_runs += 1
        self.last_step = -1

    def write(self, step: int, metrics: Metrics) -> None:
        if step <= self.last_step:
            return  # W&B drops (with a warning) any step not past the last one; see rewind
        row: dict[str, Any] = {}
        for key, value in metrics.items():
            if not isinstance(value, list | tuple):
                row[key] = value
            elif len(value) <= MAX_BINS:
                row[key] = self.wandb.Histogram(
                    np_histogram=(list(value), list(range(len(value) + 1)))
                )
        self.run.log(row, step=step)
        self.last_step = step

    def rewind(self, step: int) -> None:
        """W&B history cannot be rewritten and its steps only go forward: the values first logged
        for the rolled-back steps stay, and the recomputed steps are logged from the first step
        past the last one written."""

    def close(self) -> None:
        """Finish the run; the last sink in the process also stops the wandb service. `finish`
        returns once the service holds the records, not once they are on disk: a CI run read the
        .wandb file right after `finish` and found only its 7-byte header. Stopping the service
        closes the file. wandb's atexit hook would stop it later, but is unreliable under
        multiprocessing."""
        if self.run is None:
            return
        self.run.finish()
        self.run = None
        WandbSink.open_runs -= 1
        if WandbSink.open_runs == 0:
            self.wandb.teardown()


def _drop_inherited_service() -> None:
    """Forget a wandb service that another process started. wandb passes its service to child
    processes in WANDB_SERVICE ("3-<pid of its starter>-unix-<socket>" or "...-tcp-localhost-
    <port>"), so a run launched from a notebook or a test runner that used wandb would log
    through that process's service, which ends with it and takes the unwritten records along.
    Ours starts with this process and `finish` waits for it."""
    token = os.environ.get("WANDB_SERVICE", "")
    fields = token.split("-")
    if token and (len(fields) < 2 or fields[1] != str(os.getpid())):
        del os.environ["WANDB_SERVICE"]
