"""Megatron-LM / Megatron-DeepSpeed / NeMo / ms-swift launch scripts pasted into public GitHub
threads (tests/fixtures/megatron; index.yaml names each thread, the engine, what it says and
the verdict `dstrain check` owes it). A working script exits 0: at most warnings, with what
dstrain itself cannot run at its own level (exit 3 only when asked with --for dstrain)."""

import pytest

from tests.fixture_index import load_samples, sample_params

FIXTURES, SAMPLES = load_samples("megatron")

# Samples dstrain still judges wrongly (check_before in index.yaml says how they were judged
# when added); marked strict, so the fix that makes one pass has to remove it from here.
MISJUDGED: dict[str, str] = {}


def _samples(kind: str) -> list:
    return sample_params(SAMPLES, kind, MISJUDGED)


def _check(cli, sample: dict, *extra: str):
    args = ["check", FIXTURES / sample["file"], *extra]
    if sample.get("world_size"):
        args += ["--world-size", str(sample["world_size"])]
    return cli(*args)


def test_index_lists_every_sample_with_its_thread():
    on_disk = {p.relative_to(FIXTURES).as_posix() for p in FIXTURES.glob("*/*") if p.is_file()}
    assert on_disk == set(SAMPLES)
    for name, sample in SAMPLES.items():
        assert sample["source"].startswith("https://github.com/"), name
        assert sample["thread_says"].strip() and sample["engine"], name
        assert isinstance(sample["check_before"]["exit"], int), name
        visible = sample["expect"].get("visible_in_file", True)
        if name.startswith("broken/"):
            assert (sample["expect"]["exit"] != 0) == visible and sample["expect"]["mention"]
        else:
            assert sample["expect"]["exit"] == 0, name


def test_misjudged_samples_were_misjudged_when_added():
    wrong_before = {n for n, s in SAMPLES.items() if s["check_before"]["verdict"] != "right"}
    assert set(MISJUDGED) <= wrong_before


@pytest.mark.parametrize("name", _samples("valid"))
def test_a_working_script_gets_no_error(name, cli):
    sample = SAMPLES[name]
    result = _check(cli, sample, "--json")
    assert "traceback" not in result.text.lower(), result.text
    errors = [f for f in result.json() if f["severity"] == "error"]
    assert result.code == 0 and not errors, errors
    # The second question has its own exit code: 3 when only dstrain cannot run it.
    unsupported = any(f["severity"] == "unsupported" for f in result.json())
    assert _check(cli, sample, "--for", "dstrain").code == (3 if unsupported else 0)


@pytest.mark.parametrize("name", _samples("broken"))
def test_a_broken_script_is_caught_with_its_key(name, cli):
    sample = SAMPLES[name]
    result = _check(cli, sample)
    text = result.text.lower()
    assert "traceback" not in text, result.text
    assert result.code == sample["expect"]["exit"], result.text
    assert any(word.lower() in text for word in sample["expect"]["mention"]), result.text
