"""Close-match hints for error messages about unknown names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def did_you_mean(name: str, candidates: Iterable[str], taken: Iterable[str] = ()) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or an empty string.

    Args:
        name: the unknown or missing name.
        candidates: the names there are.
        taken: names never suggested: those that are also expected, and so are present under
            their own name (a file missing ``cat_3`` that holds ``cat_23`` needs ``cat_23`` as
            itself; it is no typo of ``cat_3``).
    """
    taken = set(taken)
    free = [c for c in candidates if c not in taken]
    close = difflib.get_close_matches(name, free, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def quoted_with_hints(
    names: Sequence[str], candidates: Iterable[str], taken: Iterable[str] = ()
) -> str:
    """``'a' (did you mean 'b'?), 'c'``: each name quoted, with its closest candidate that is
    not ``taken`` (see :func:`did_you_mean`)."""
    candidates, taken = list(candidates), set(taken)
    return ", ".join(f"'{n}'{did_you_mean(n, candidates, taken)}" for n in names)
