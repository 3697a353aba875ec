"""Raw 64-bit keys: stable value hashes and the invertible mixer of synthetic ids."""

import numpy as np
import pyarrow as pa
import pytest

from recsys.data.keys import (
    MISSING_KEY,
    mix63,
    synthetic_id_numbers,
    synthetic_keys,
    unmix63,
    value_keys,
)


def _reference_key(text: str) -> int:
    """The documented scheme, one value at a time: fmix64(fnv1a64(utf8)) >> 1, at least 1."""
    mask = (1 << 64) - 1
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & mask
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        h = ((h ^ (h >> 33)) * multiplier) & mask
    h ^= h >> 33
    return max(h >> 1, 1)


def test_keys_follow_the_documented_scheme():
    rng = np.random.default_rng(0)
    texts = ["", "a", "0000000f", "héllo wörld", "x" * 300]
    texts += ["".join(rng.choice(list("abc0123é"), rng.integers(1, 40))) for _ in range(50)]
    keys = value_keys(pa.array(texts))
    assert keys.dtype == np.int64
    assert keys.tolist() == [_reference_key(t) for t in texts]
    # pinned: a change of scheme must be a deliberate, fingerprinted one
    assert value_keys(pa.array(["a"]))[0] == 0x415154AC54DF672D


def test_keys_are_stable_and_separate_values():
    rng = np.random.default_rng(1)
    values = [f"{v:08x}" for v in rng.integers(0, 1 << 32, 20_000)]
    keys = value_keys(pa.array(values))
    # the same value gives the same key however the array is cut, typed or chunked
    again = np.concatenate(
        [value_keys(pa.array(values[i : i + 777])) for i in range(0, 20_000, 777)]
    )
    assert np.array_equal(keys, again)
    assert np.array_equal(keys[5:], value_keys(pa.array(values).slice(5)))
    assert np.array_equal(keys, value_keys(pa.array(values, pa.large_string())))
    assert np.array_equal(keys, value_keys(pa.chunked_array([values[:3], values[3:]])))
    # equal values -> equal keys, different values -> different keys (on this sample)
    distinct_values, first = np.unique(values, return_index=True)
    assert len(np.unique(keys)) == len(distinct_values)
    assert np.array_equal(np.unique(keys[first]), np.unique(keys))
    assert keys.min() >= 1


def test_integers_hash_as_their_decimal_text_and_nulls_are_missing():
    ints = value_keys(pa.array([12, -3, None, 0], pa.int64()))
    texts = value_keys(pa.array(["12", "-3", None, "0"]))
    assert ints.tolist() == texts.tolist()
    assert ints[2] == MISSING_KEY == 0
    assert value_keys(pa.array([12], pa.int32()))[0] == ints[0]
    assert value_keys(pa.array([None, None], pa.string())).tolist() == [0, 0]
    assert value_keys(pa.array([], pa.string())).shape == (0,)
    with pytest.raises(ValueError, match="no text to hash"):
        value_keys(pa.array([[1, 2]]))


def test_mix63_is_a_bijection_with_an_inverse():
    rng = np.random.default_rng(2)
    x = np.concatenate([np.arange(1000), rng.integers(0, 1 << 63, 10_000, dtype=np.int64)])
    y = mix63(x)
    assert y.min() >= 0 and len(np.unique(y)) == len(x)
    assert np.array_equal(unmix63(y), x)
    # consecutive inputs land far apart (no linear structure left)
    assert np.abs(np.diff(y[:1000].astype(np.float64))).min() > 1e6


def test_synthetic_keys_round_trip():
    numbers = np.array([0, 1, 7, (1 << 40) - 1])
    for feature in (0, 3, 25):
        keys = synthetic_keys(feature, numbers)
        assert keys.min() >= 1
        features, back = synthetic_id_numbers(keys)
        assert features.tolist() == [feature] * 4 and back.tolist() == numbers.tolist()
    assert not np.intersect1d(synthetic_keys(0, numbers), synthetic_keys(1, numbers)).size
