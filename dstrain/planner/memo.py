"""Memoization keyed on the model by identity: the search asks the same questions of one
ModelArgs tens of thousands of times, and hashing a pydantic model costs more than most answers.
The cache keeps the models it has seen alive, so an id is never reused while cached."""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def per_model(fn: Callable[..., T]) -> Callable[..., T]:
    """Cache `fn(args, *rest)` on (id(args), *rest); `rest` must be hashable."""
    cache: dict[tuple, T] = {}
    models: dict[int, Any] = {}

    @functools.wraps(fn)
    def cached(args: Any, *rest: Any) -> T:
        key = (id(args), *rest)
        if key in cache:
            return cache[key]
        models[id(args)] = args
        cache[key] = value = fn(args, *rest)
        return value

    return cached
