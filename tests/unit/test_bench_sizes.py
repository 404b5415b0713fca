"""`--sizes MIN:MAX` and `--step-factor`, as nccl-tests' -b/-e/-f take them."""

import pytest

from dstrain.bench.sizes import human, parse_size, parse_sizes
from dstrain.errors import UserError


def test_units_are_powers_of_1024():
    assert parse_size("1K") == 1024
    assert parse_size("64M") == 64 * 1024**2
    assert parse_size("1G") == 1024**3
    assert parse_size("4096") == 4096
    assert parse_size("2kb") == parse_size("2KiB") == 2048


def test_sweep_doubles_and_includes_both_ends():
    assert parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("1K:64M")[-1] == 64 * 1024**2 and len(parse_sizes("1K:64M")) == 17


def test_step_factor_and_single_size():
    assert parse_sizes("1K:64K", factor=4) == [1024, 4096, 16384, 65536]
    assert parse_sizes("1K:100K", factor=8) == [1024, 8192, 65536]  # stops below MAX
    assert parse_sizes("1M") == [1024**2]


@pytest.mark.parametrize("text", ["", "K", "1X", "1.5M", "-1K", "0", "1K:", "abc:1M", "64M:1K"])
def test_bad_sizes_are_one_clear_error(text):
    with pytest.raises(UserError) as exc:
        parse_sizes(text)
    assert "--sizes" in exc.value.message and "1K:64M" in exc.value.fix


def test_step_factor_below_two_is_an_error():
    with pytest.raises(UserError, match="step-factor"):
        parse_sizes("1K:1M", factor=1)


def test_human():
    assert [human(s) for s in (1024, 64 * 1024**2, 1024**3, 1536)] == ["1K", "64M", "1G", "1536"]
