"""Property tests: whatever the input, `check` and `convert` answer with a message and an exit code,
never a traceback."""

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstrain.interop.ds_keys import DS_SECTION_KEYS, DS_TOP_LEVEL
from dstrain.preflight.explain import explain
from tests.conftest import SHARED, run_cli

KEYS = [d.key for d in explain()]
DS_KEYS = sorted(DS_TOP_LEVEL) + [f"{s}.{k}" for s, keys in DS_SECTION_KEYS.items() for k in keys]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "cpu", "none", "1f1b", "bf16", "deepseek-v3", "-1", "H100"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _nest(pairs):
    data: dict = {}
    for dotted, value in pairs:
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return data


native = st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=8).map(_nest)
deepspeed = st.lists(st.tuples(st.sampled_from(DS_KEYS), values), max_size=8).map(_nest)
anything = st.dictionaries(st.text(max_size=10), values, max_size=6)

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _answer(path: Path, *extra: str) -> None:
    for args in (
        ("check", path, *extra),
        ("check", path, "--json", *extra),
        ("convert", path, "-o", path.with_suffix(".out.toml")),
    ):
        result = run_cli(*args)
        assert result.code in (0, 1, 2), result.text
        assert "Traceback" not in result.text


def _in_tmp(text: str, suffix: str) -> Path:
    folder = Path(tempfile.mkdtemp())
    path = folder / f"input{suffix}"
    path.write_text(text)
    return path


@SETTINGS
@given(data=native, world=st.integers(1, 4096))
def test_random_native_configs(data, world):
    _answer(_in_tmp(json.dumps(data, default=str), ".json"), "--world-size", str(world))


@SETTINGS
@given(data=deepspeed, world=st.integers(1, 4096))
def test_random_deepspeed_configs(data, world):
    _answer(_in_tmp(json.dumps(data, default=str), ".json"), "--world-size", str(world))


@SETTINGS
@given(data=anything)
def test_random_json(data):
    _answer(_in_tmp(json.dumps(data, default=str), ".json"))


@SETTINGS
@given(text=st.text(max_size=200), suffix=st.sampled_from([".toml", ".yaml", ".json", ".cfg"]))
def test_random_text(text, suffix):
    _answer(_in_tmp(text, suffix))


def test_yaml_keys_that_are_not_names():
    # Found by test_random_text in CI: YAML reads `?` as {None: None} and `1: x` as {1: "x"}.
    for text in ("?\n", "1: 2\n", "train:\n  3: 4\n"):
        path = _in_tmp(text, ".yaml")
        result = run_cli("check", path)
        assert result.code == 2 and "is not a name" in result.text, result.text
        _answer(path)


def _real_inputs() -> list[str]:
    files = sorted(SHARED.glob("**/*.json")) if SHARED.exists() else []
    return [p.read_text() for p in files] or ['{"train_batch_size": 8, "fp16": {"enabled": true}}']


@SETTINGS
@given(source=st.sampled_from(_real_inputs()), cut=st.floats(0, 1))
def test_truncated_real_files(source, cut):
    _answer(_in_tmp(source[: int(len(source) * cut)], ".json"))
