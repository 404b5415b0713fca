"""The deeper DeepSpeed verdict (`check --deepspeed-initialize`): `deepspeed.initialize` and one
optimizer step with the config, on a tiny model, one rank over gloo, on DeepSpeed's CPU
accelerator. What DeepSpeed's config loader accepts but its engine refuses once it builds the
optimizer or takes a step (a gradient_clipping written as a string, an optimizer its builder
cannot make) shows here, in the engine's own words.

It runs in a child process (`python -m dstrain.interop.ds_initialize`), which keeps DeepSpeed's
global state, its process group and its op compiles out of check's process. The child reads one
JSON request per stdin line and answers one JSON line each, so a benchmark judges many configs
with one start.

No torch or DeepSpeed code does this for us: DeepSpeed's own unit tests build engines the same
way (a small torch.nn model, one rank), but ship no entry point that takes a config file.
"""

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

# Answers of the child, per config.
ACCEPTS, REFUSES, UNJUDGED = "accepts", "refuses", "unjudged"
# The first use compiles DeepSpeed's CPU ops (the shm comm op, fused Adam, CPU Adam: about a
# minute each on 2 cores); later uses load them from torch's extension cache.
_TIMEOUT_S = 900
_HIDDEN = 16


@dataclass
class Answer:
    verdict: str  # ACCEPTS, REFUSES or UNJUDGED
    message: str = ""


def initialize(configs: list[tuple[dict[str, Any], int]]) -> list[Answer]:
    """Each (config, world size) through deepspeed.initialize and one optimizer step in one
    child process; the batch triple is scaled to one rank first (train_batch_size = micro x
    accumulation). A child that dies answers UNJUDGED for what it did not reach."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    lines = "".join(json.dumps({"config": c, "world": w}) + "\n" for c, w in configs)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dstrain.interop.ds_initialize"],
            input=lines,
            capture_output=True,
            text=True,
            env=env,
            timeout=_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return [Answer(UNJUDGED, f"deepspeed.initialize took over {_TIMEOUT_S} s")] * len(configs)
    answers = [Answer(**json.loads(line)) for line in done.stdout.splitlines() if line.strip()]
    if len(answers) < len(configs):
        tail = " ".join(done.stderr.strip().splitlines()[-3:])[-300:]
        lost = Answer(UNJUDGED, f"the child process stopped (exit {done.returncode}): {tail}")
        answers += [lost] * (len(configs) - len(answers))
    return answers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- the child process


def _one_rank(config: dict[str, Any], world: int) -> dict[str, Any]:
    """`config` with its batch triple as DeepSpeed resolves it at `world` ranks, scaled to one
    rank: the engine then runs what each rank of the real world runs."""
    from types import SimpleNamespace
    from unittest import mock

    from deepspeed.runtime import config as ds_config

    fake = SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda group=None: world)
    with mock.patch.object(ds_config, "dist", fake):
        loaded = ds_config.DeepSpeedConfig(config)
    micro, steps = loaded.train_micro_batch_size_per_gpu, loaded.gradient_accumulation_steps
    return {
        **config,
        "train_batch_size": micro * steps,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": steps,
    }


def _run(config: dict[str, Any], world: int) -> Answer:
    import deepspeed
    import torch

    config = _one_rank(config, world)
    tp = config.get("tensor_parallel", {}).get("autotp_size", 1)
    if isinstance(tp, int) and tp > 1:
        return Answer(UNJUDGED, f"tensor_parallel.autotp_size = {tp} needs {tp} ranks, not one")
    model = torch.nn.Sequential(torch.nn.Linear(_HIDDEN, _HIDDEN), torch.nn.Linear(_HIDDEN, 1))
    # A file with no optimizer section trains the launcher's own: AdamW here, handed in as
    # DeepSpeed's client optimizer with zero_allow_untested_optimizer, as the HF Trainer does
    # (transformers/integrations/deepspeed.py, deepspeed_optim_sched).
    client = None
    if "optimizer" not in config:
        client = torch.optim.AdamW(model.parameters(), lr=1e-4)
        config = {"zero_allow_untested_optimizer": True, **config}
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=client,
        config=config,
        dist_init_required=False,
    )
    try:
        dtype = next(engine.module.parameters()).dtype
        batch = torch.ones(config["train_micro_batch_size_per_gpu"], _HIDDEN, dtype=dtype)
        for _ in range(config["gradient_accumulation_steps"]):  # up to the optimizer step
            loss = engine(batch).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
    finally:
        engine.destroy()
    return Answer(ACCEPTS)


def _environment_limit(exc: BaseException, trace: str) -> str | None:
    """Why the engine could not be judged here, when the failure is this machine's, not the
    config's: an op that does not build, or a dtype the CPU accelerator lacks."""
    text = str(exc)
    if "op_builder" in trace or "Unable to JIT load" in text or "ninja" in text.lower():
        return f"a DeepSpeed op does not build here: {' '.join(text.split())[:300]}"
    if "is not supported on your device" in text:
        return f"DeepSpeed's CPU accelerator cannot run it: {text}"
    return None


def _where(exc: BaseException) -> str:
    """The innermost DeepSpeed frame that raised, as "(deepspeed/runtime/engine.py:3506)"."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/deepspeed/" in f.filename]
    if not frames:
        return ""
    path = frames[-1].filename
    return f" ({path[path.rindex('/deepspeed/') + 1 :]}:{frames[-1].lineno})"


def main() -> None:
    import importlib
    import logging
    import traceback
    import warnings

    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    # The shared-memory all-reduce op speeds collectives between CPU ranks; one rank has none to
    # speed, and building it costs a minute of compiling on first use.
    # (`deepspeed.comm.torch` as an attribute is torch itself, which deepspeed.comm re-exports.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    # The CPU accelerator reports no fp16, so the engine refuses fp16 configs outright; but its
    # fp16 paths (the loss scaler, the fp16 optimizer wrappers) run on CPU tensors. Said yes here,
    # an fp16 config is judged rather than refused.
    cpu = get_accelerator()
    cpu.is_fp16_supported = lambda: True
    cpu.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    out = sys.stdout
    sys.stdout = sys.stderr  # DeepSpeed prints; only answers go to the parent
    dist.init_process_group("gloo", rank=0, world_size=1)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = _run(request["config"], request["world"])
        except Exception as exc:  # the engine's refusal, whatever it raises
            limit = _environment_limit(exc, traceback.format_exc())
            message = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}{_where(exc)}"
            answer = Answer(UNJUDGED, limit) if limit else Answer(REFUSES, message)
        out.write(json.dumps(answer.__dict__) + "\n")
        out.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
