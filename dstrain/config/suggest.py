"""'Did you mean' suggestions for misspelt keys, flavors and names."""

import difflib
from collections.abc import Iterable


def closest(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The candidate most like `word`, ignoring case and `-`/`_`, or None when none is close."""
    pool = list(candidates)
    normalized = {_normalize(c): c for c in pool}
    exact = normalized.get(_normalize(word))
    if exact is not None:
        return exact
    match = difflib.get_close_matches(_normalize(word), list(normalized), n=1, cutoff=cutoff)
    if match:
        return normalized[match[0]]
    # A key that contains a valid key ("offload_params" vs "offload_param") or is contained by one.
    contained = [c for c in pool if len(c) > 3 and (c in word or word in c)]
    return max(contained, key=len) if contained else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """' (did you mean `x`?)' or '' when nothing is close."""
    match = closest(word, candidates)
    return f" (did you mean `{match}`?)" if match and match != word else ""


def _normalize(word: str) -> str:
    return word.lower().replace("-", "_")
