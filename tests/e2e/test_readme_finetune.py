"""The fine-tuning example of docs/training.md, run as written (its /tmp/ft moved under the test's
own directory): a tiny DeepSeek-V3 made with transformers, its tokenizer folder and instruction
JSONL, fine-tuned with `model.init_from` + `data.tokenizer` + validation, then exported. The run
starts from the checkpoint's weights (its first loss is the untrained model's, about ln 1024),
learns (the validation loss falls at every evaluation), and the export is a loadable folder."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _block() -> str:
    page = (REPO / "docs" / "training.md").read_text()
    found = re.search(r"<!-- finetune-example -->\n```bash\n(.*?)```", page, re.S)
    assert found, "docs/training.md's fine-tuning block is missing"
    return found.group(1)


def test_the_documented_finetuning_example_runs(tmp_path):
    script = _block().replace("/tmp/ft", str(tmp_path / "ft"))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = tmp_path / "ft" / "runs" / "finetune"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(line["step"], line["eval/loss"]) for line in lines if "eval/loss" in line]
    assert [step for step, _ in evals] == [10, 20, 30]
    assert evals[0][1] > evals[1][1] > evals[2][1], evals
    first = lines[0]["loss/main"]
    assert 5.0 < first < 7.0, first  # at step 10, from the random checkpoint's ~ln 1024 = 6.93
    assert "initial weights: " in done.stderr and "the optimizer starts fresh" in done.stderr
    exported = json.loads(done.stdout[done.stdout.index("{") :])
    folder = tmp_path / "ft" / "exported"
    assert (folder / "config.json").exists() and list(folder.glob("*.safetensors"))
    assert exported["dtype"] == "bf16", exported
    summary = json.loads((run / "summary.json").read_text())
    print(
        f"fine-tune: loss {first:.3f} -> {lines[-1]['loss/main']:.3f}, eval "
        + " -> ".join(f"{loss:.3f}" for _, loss in evals)
        + f", {summary['tokens_per_s']:,.0f} tokens/s"
    )
