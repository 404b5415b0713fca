"""Message sizes as nccl-tests takes them: `-b MIN -e MAX -f FACTOR`, here `--sizes MIN:MAX` and
`--step-factor F`. K, M and G are powers of 1024, as in nccl-tests' `parsesize`."""

from dstrain.errors import UserError

UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_FIX = (
    "give sizes in bytes as MIN:MAX (or one size), K, M and G being 1024, 1024^2 and 1024^3: "
    "e.g. --sizes 1K:64M"
)


def parse_size(text: str) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '4096' -> 4096 (also '1KB', '1KiB'); UserError otherwise."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in UNITS else ""
    number = raw[: len(raw) - len(unit)]
    if not number.isdigit():
        raise UserError(f"--sizes: {text!r} is not a size in bytes", _FIX)
    size = int(number) * UNITS[unit]
    if size < 1:
        raise UserError(f"--sizes: {text!r} is zero bytes", _FIX)
    return size


def parse_sizes(text: str, factor: int = 2) -> list[int]:
    """MIN, MIN*F, MIN*F^2, ... up to MAX (nccl-tests' -b/-e/-f loop; MAX is included only when
    the steps land on it). One size alone ('1M') is a sweep of one."""
    first, sep, last = text.partition(":")
    low = parse_size(first)
    high = parse_size(last) if sep else low
    if low > high:
        raise UserError(f"--sizes {text}: the first size is larger than the last", _FIX)
    if factor < 2:
        raise UserError(
            f"--step-factor {factor}: must be 2 or more", "use --step-factor 2 (doubling)"
        )
    sizes = [low]
    while sizes[-1] * factor <= high:
        sizes.append(sizes[-1] * factor)
    return sizes


def human(size: int) -> str:
    """1024 -> '1K', 67108864 -> '64M', 1536 -> '1536'."""
    for unit in ("T", "G", "M", "K"):
        if size >= UNITS[unit] and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]}{unit}"
    return str(size)
