"""Close-match hints for error messages about unknown names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string."""
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def quoted_with_hints(names: Sequence[str], candidates: Iterable[str]) -> str:
    """``'a' (did you mean 'b'?), 'c'``: each name quoted, with its closest candidate."""
    candidates = list(candidates)
    return ", ".join(f"'{n}'{did_you_mean(n, candidates)}" for n in names)
