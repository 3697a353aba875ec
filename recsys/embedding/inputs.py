"""The checks every embedding collection makes on its input KeyedJaggedTensor before a lookup:
one batch size for all keys, weights when the collection is weighted, and every feature it
reads present (a missing one is named, with the closest key as a hint)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec import KeyedJaggedTensor

from recsys._suggest import quoted_with_hints


def input_weights(features: KeyedJaggedTensor, is_weighted: bool) -> torch.Tensor | None:
    """The per-id weights a collection pools with (None when it is not weighted), after
    checking the input's shape.

    Raises:
        ValueError: a KeyedJaggedTensor with a batch size per key, or a weighted collection
            given no weights.
    """
    if features.variable_stride_per_key():
        raise ValueError("KeyedJaggedTensor with a variable batch size per key is not supported")
    if not is_weighted:
        return None
    weights = features.weights_or_none()
    if weights is None:
        raise ValueError(
            "this collection is weighted (is_weighted=True) but the input KeyedJaggedTensor has "
            "no weights"
        )
    return weights


def is_symbolic(features: KeyedJaggedTensor) -> bool:
    """Whether ``features`` is being traced by ``torch.fx`` (the KJT itself, or its tensors,
    are proxies): its values cannot be read."""
    return isinstance(features, torch.fx.Proxy) or isinstance(features.values(), torch.fx.Proxy)


class FeatureOrder:
    """Where each of a collection's features is among an input's keys, cached per key tuple
    (a batch's keys rarely change)."""

    def __init__(self, features: Sequence[str]) -> None:
        self.features = list(features)
        self._cache: dict[tuple[str, ...], list[int]] = {}

    def positions(self, keys: Sequence[str]) -> list[int]:
        """The index in ``keys`` of every feature, in the collection's order.

        Raises:
            ValueError: a feature is not among ``keys`` (named, with hints).
        """
        cache_key = tuple(keys)
        if cache_key not in self._cache:
            position = {k: i for i, k in enumerate(keys)}
            missing = [f for f in self.features if f not in position]
            if missing:
                hints = quoted_with_hints(missing, keys, taken=self.features)
                raise ValueError(
                    f"KeyedJaggedTensor is missing features {hints} "
                    f"of this collection; its keys are {list(keys)}, the collection expects "
                    f"{self.features}"
                )
            self._cache[cache_key] = [position[f] for f in self.features]
        return self._cache[cache_key]


def feature_spans(features: KeyedJaggedTensor) -> dict[str, slice]:
    """Where in ``features.values()`` each key's ids are."""
    offsets = features.offset_per_key()
    return {key: slice(offsets[i], offsets[i + 1]) for i, key in enumerate(features.keys())}


def feature_positions(spans: dict[str, slice], features: list[str]) -> slice | torch.Tensor:
    """The positions of the ids of ``features`` (``spans`` from :func:`feature_spans`): a slice
    for one feature (a view, no copy), else their indices."""
    if len(features) == 1:
        return spans[features[0]]
    return torch.cat([torch.arange(spans[f].start, spans[f].stop) for f in features])


def sample_range(features: KeyedJaggedTensor, start: int, end: int) -> KeyedJaggedTensor:
    """Samples ``[start, end)`` of ``features`` (every key's bags of them, weights too)."""
    num_keys, batch_size = len(features.keys()), features.stride()
    offsets = features.offsets()
    first = torch.arange(num_keys, device=offsets.device) * batch_size + start
    low, high = offsets[first].tolist(), offsets[first + (end - start)].tolist()
    spans = [slice(a, b) for a, b in zip(low, high, strict=True)]
    weights = features.weights_or_none()
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=torch.cat([features.values()[span] for span in spans]),
        weights=None if weights is None else torch.cat([weights[span] for span in spans]),
        lengths=features.lengths().view(num_keys, batch_size)[:, start:end].reshape(-1),
        stride=end - start,
    )
