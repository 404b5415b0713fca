"""`dstrain train` as a user runs it: the run directory, a falling loss, exact resume, and clear
errors for bad data."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from dstrain.checkpoint import store
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~300 KB of real Python source as a .txt corpus (one document per file)."""
    folder = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json", "email", "logging", "asyncio", "http"):
        for source in sorted((stdlib / name).glob("*.py"))[:12]:
            (folder / f"{name}_{source.stem}.txt").write_text(source.read_text())
    return folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _train(corpus: Path, cache: Path, root: Path, *extra: str):
    return run_cli(
        "train",
        "--set",
        f"data.source={corpus}",
        "--set",
        f"data.cache_dir={cache}",
        "--set",
        f"run.root={root}",
        "--set",
        "train.seq_len=64",
        "--set",
        "train.micro_batch_size=8",
        "--set",
        "metrics.log_interval=1",
        "--set",
        "lr.warmup_steps=5",
        *extra,
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_leaves_its_directory_and_learns(corpus, cache, tmp_path):
    result = _train(
        corpus,
        cache,
        tmp_path,
        "--set",
        "train.steps=40",
        "--set",
        "checkpoint.interval=15",
        "--set",
        "checkpoint.keep_last_k=2",
    )
    assert result.code == 0, result.text
    run = tmp_path / "default"
    assert (run / "config.toml").read_text().count("steps = 40") == 1
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 41))
    for key in (
        "loss/main",
        "loss/mtp",
        "optim/lr",
        "optim/grad_norm",
        "throughput/tokens_per_s",
        "throughput/mfu",
    ):
        assert all(key in r for r in rows), key
    first = sum(r["loss/main"] for r in rows[:5]) / 5
    last = sum(r["loss/main"] for r in rows[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(2048) = 7.6 down by well over a nat
    assert list((run / "tb").glob("events.out.tfevents.*"))
    kept = [p.name for p in store.checkpoints(run / "checkpoints")]
    assert kept == ["step-30", "step-40"]  # every 15 steps and at the end; keep_last_k = 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-40"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens_per_s"] > 0
    again = _train(corpus, cache, tmp_path, "--set", "train.steps=40", "--json")
    assert again.code == 0 and "already complete at step 40" in again.err
    done = json.loads(again.out)  # stdout is the JSON alone; the notes are on stderr
    assert done["already_complete"] and done["steps"] == 40 and done["run_dir"] == str(run)


def test_resume_is_bit_identical(corpus, cache, tmp_path):
    fixed = ("--set", "lr.decay_steps=11", "--set", "checkpoint.interval=100")
    whole = _train(corpus, cache, tmp_path / "a", "--set", "train.steps=16", *fixed)
    first = _train(corpus, cache, tmp_path / "b", "--set", "train.steps=8", *fixed)
    rest = _train(corpus, cache, tmp_path / "b", "--set", "train.steps=16", *fixed)
    assert whole.code == first.code == rest.code == 0, rest.text
    assert "resumed from" in rest.err and "step 8" in rest.err
    a, b = _metrics(tmp_path / "a" / "default"), _metrics(tmp_path / "b" / "default")
    assert [r["step"] for r in b] == list(range(1, 17))
    for key in ("loss/main", "loss/mtp", "optim/grad_norm", "optim/lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    weights_a = _weights(tmp_path / "a" / "default")
    weights_b = _weights(tmp_path / "b" / "default")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(str(store.latest(run / "checkpoints"))),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return {k: v for k, v in state["model"].items()}


def test_missing_data_is_one_clear_error(tmp_path):
    result = run_cli(
        "train", "--set", f"data.source={tmp_path / 'nope.jsonl'}", "--set", f"run.root={tmp_path}"
    )
    assert result.code == 1
    assert "data path not found" in result.err and "Traceback" not in result.text
    assert not (tmp_path / "default").exists()


def test_empty_corpus_is_one_clear_error(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "empty.txt").write_text("   \n")
    result = run_cli(
        "train",
        "--set",
        f"data.source={tmp_path / 'data'}",
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        "--set",
        f"run.root={tmp_path}",
    )
    assert result.code != 0 and "Traceback" not in result.text
    assert "empty" in result.err.lower()


def test_resume_from_a_missing_checkpoint(tmp_path):
    result = run_cli("train", "--resume", str(tmp_path / "ckpt"), "--set", f"run.root={tmp_path}")
    assert result.code == 1 and "checkpoint to resume from not found" in result.err


def test_export_hf_loads_in_transformers_with_the_same_logits(corpus, cache, tmp_path):
    transformers = pytest.importorskip("transformers")
    assert _train(corpus, cache, tmp_path, "--set", "train.steps=3").code == 0
    out = tmp_path / "hf"
    result = run_cli("ckpt", "export-hf", tmp_path / "default", "-o", out, "--dtype", "fp32")
    assert result.code == 0, result.text
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    from dstrain.checkpoint.export import _locate
    from dstrain.config.flavors import resolve_model_args
    from dstrain.config.load import load_config
    from dstrain.model.transformer import build_model

    args = resolve_model_args(load_config(tmp_path / "default" / "config.toml").config.model)
    ours = build_model(args)
    state = {"model": ours.state_dict()}
    store.load(_locate(tmp_path / "default")[1], state)
    ours.load_state_dict(state["model"])
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(tokens).logits, ours.eval()(tokens)[0]
    # fp32 logits up to 0.95: measured 3.0e-7 (AVX512) and 2.4e-7 (AVX2 kernels); bound 1e-6.
    assert (theirs - mine).abs().max().item() < 1e-6


def test_export_hf_bad_source(tmp_path):
    result = run_cli("ckpt", "export-hf", tmp_path, "-o", tmp_path / "out")
    assert result.code == 1 and "neither a run directory nor a checkpoint" in result.err


def test_sharded_export_round_trips_through_init_from(corpus, cache, tmp_path):
    """bf16 by default, in several files with an index; `--dtype fp32` and `model.init_from`
    give the checkpoint's weights back bit for bit; bad -o and damaged checkpoints are one
    clear message."""
    import json

    from dstrain.checkpoint.export import _locate

    assert _train(corpus, cache, tmp_path, "--set", "train.steps=2").code == 0
    run = tmp_path / "default"
    bf16 = run_cli(
        "ckpt", "export-hf", run, "-o", tmp_path / "bf16", "--shard-size", "2M", "--json"
    )
    assert bf16.code == 0, bf16.text
    report = bf16.json()
    files = sorted((tmp_path / "bf16").glob("*.safetensors"))
    assert report["files"] == len(files) > 1 and report["dtype"] == "bf16"
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    fp32 = run_cli("ckpt", "export-hf", run, "-o", tmp_path / "fp32", "--dtype", "fp32")
    assert fp32.code == 0, fp32.text
    # Round trip: a new run from the export holds the checkpoint's weights, bit for bit.
    from dstrain.config.load import load_config
    from dstrain.train.trainer import Trainer

    saved = {"model": {}}
    ckpt = _locate(run)[1]
    trainer = Trainer(
        load_config(
            None,
            [
                f"model.init_from={tmp_path / 'fp32'}",
                f"data.source={corpus}",
                f"data.cache_dir={cache}",
                f"run.root={tmp_path}",
                "run.name=from_export",
                "train.seq_len=32",
            ],
        ).config
    )
    ours = trainer.model.state_dict()
    saved["model"] = {k: torch.empty_like(v) for k, v in ours.items() if "tokens_per" not in k}
    store.load(ckpt, saved)
    for name, value in saved["model"].items():
        assert torch.equal(ours[name], value), name
    _check_mtp_copies(tmp_path / "fp32", run, corpus, cache)
    # Bad -o: a file, or a folder that already holds a model.
    (tmp_path / "a_file").write_text("x")
    for target, words in ((tmp_path / "a_file", "is a file"), (tmp_path / "fp32", "already holds")):
        bad = run_cli("ckpt", "export-hf", run, "-o", target)
        assert bad.code == 1 and words in bad.err and "Traceback" not in bad.text, bad.text
    # A damaged checkpoint named explicitly.
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    damaged = run_cli("ckpt", "export-hf", ckpt, "-o", tmp_path / "damaged")
    assert damaged.code == 1 and "not a valid checkpoint" in damaged.err, damaged.text


def test_fresh_refuses_to_mix_two_runs(corpus, cache, tmp_path):
    assert _train(corpus, cache, tmp_path, "--set", "train.steps=2").code == 0
    again = _train(corpus, cache, tmp_path, "--set", "train.steps=2", "--fresh")
    assert again.code == 1 and "already holds checkpoints" in again.err
    assert (tmp_path / "default" / "checkpoints" / "step-2").exists()  # nothing was lost


def _check_mtp_copies(export: Path, run: Path, corpus: Path, cache: Path) -> None:
    """As DeepSeek's release, the MTP layer (here layer 4 of the debug flavor) holds copies of
    the embedding and the head; `ckpt verify-hf` accepts the export; a copy that differs from
    its main tensor is refused at load, naming it."""
    import json

    from safetensors.torch import load_file, save_file

    from dstrain.config.load import load_config
    from dstrain.errors import UserError
    from dstrain.train.trainer import Trainer

    weight_map = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]

    def tensor(name: str) -> torch.Tensor:
        return load_file(str(export / weight_map[name]))[name]

    copies = {
        "model.layers.4.embed_tokens.weight": "model.embed_tokens.weight",
        "model.layers.4.shared_head.head.weight": "lm_head.weight",
    }
    for copy, main in copies.items():
        assert torch.equal(tensor(copy), tensor(main)), copy
    verified = run_cli("ckpt", "verify-hf", export, "--config", run / "config.toml", "--json")
    assert verified.code == 0 and verified.json()["ok"], verified.text
    assert verified.json()["tensors"] == len(weight_map)
    file = export / weight_map["model.layers.4.shared_head.head.weight"]
    tensors = load_file(str(file))
    tensors["model.layers.4.shared_head.head.weight"][7] += 1.0
    save_file(tensors, str(file), metadata={"format": "pt"})
    overrides = [
        f"model.init_from={export}",
        f"data.source={corpus}",
        f"data.cache_dir={cache}",
        f"run.root={run.parent}",
        "run.name=from_changed_copy",
        "train.seq_len=32",
    ]
    with pytest.raises(UserError) as caught:
        Trainer(load_config(None, overrides).config)
    message = caught.value.message
    assert "model.layers.4.shared_head.head.weight differs from lm_head.weight" in message
    assert "first row 7" in message and "num_mtp_modules=0" in caught.value.fix


def test_fp8_export_is_the_release_format_and_loads_back(corpus, cache, tmp_path):
    """`--dtype fp8` writes exactly the names, dtypes and shapes DeepSeek-V3's release holds for
    this architecture (judged by `tests/release_replica.py`, built from the release's facts, not
    from dstrain), `verify-hf` accepts it, and `init_from` reads back the dequantised weights,
    which quantise again to the very bytes written."""
    import json

    from safetensors import safe_open

    from dstrain.checkpoint.export import _locate
    from dstrain.config.load import load_config
    from dstrain.model.fp8 import dequantize, quantize_blocks
    from dstrain.train.trainer import Trainer
    from tests.release_replica import tensors_for_config

    assert _train(corpus, cache, tmp_path, "--set", "train.steps=2").code == 0
    run, out = tmp_path / "default", tmp_path / "fp8"
    exported = run_cli("ckpt", "export-hf", run, "-o", out, "--dtype", "fp8", "--json")
    assert exported.code == 0, exported.text
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    written = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                part = handle.get_slice(name)
                written[name] = (part.get_dtype(), tuple(part.get_shape()))
    assert written == tensors_for_config(config)
    verified = run_cli("ckpt", "verify-hf", out, "--config", run / "config.toml")
    assert verified.code == 0, verified.text
    trainer = Trainer(
        load_config(
            None,
            [
                f"model.init_from={out}",
                f"data.source={corpus}",
                f"data.cache_dir={cache}",
                f"run.root={tmp_path}",
                "run.name=from_fp8",
                "train.seq_len=32",
            ],
        ).config
    )
    assert trainer.init_from is not None
    name = "layers.1.attention.wkv_a.weight"
    original = {"model": {name: torch.empty(trainer.model.state_dict()[name].shape)}}
    store.load(_locate(run)[1], original)
    loaded = trainer.model.state_dict()[name]
    q = quantize_blocks(original["model"][name])
    assert torch.equal(loaded, dequantize(q))  # the FP8 values, exactly
    again = quantize_blocks(loaded)
    assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(again.scale, q.scale)
