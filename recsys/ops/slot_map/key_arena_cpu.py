"""The CPU loops of a key arena's lookup, compiled C: one pass over a batch's ids each.

On CPU a key arena (:mod:`recsys.embedding.dynamic.key_arena`) finds each id's slot through a hint
(scanning its bucket where the hint fails) and updates the slots the batch uses; as tensor ops
that is about twenty passes over the ids (hash, gathers, compares, ``nonzero``, a scan of the
[U, S] bucket rows of the ids whose hint failed, a scatter and gather to count distinct keys,
more scatters), each a random access per id. :func:`find` and :func:`touch` do the same in
one loop each (``key_arena_cpu.c``): the same slots, hit counts, scores and last steps bit for
bit (tested against the tensor ops), deterministic, single-threaded. One difference in how,
not what: the loop scans the bucket of an id whose hint failed at once (the tensor ops list
those ids with a host read, then scan), so it lists only the ids their map does not hold.
A training step calls both at once through :class:`ArenaLoops` (bound to the arena's buffers,
checked once): one foreign call for a step whose keys are all held.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``; ``-O2``,
no machine-specific flags) into ``$RECSYS_CACHE_DIR`` (default ``~/.cache/recsys``), keyed by
the source's hash, written atomically; a later process loads it in a millisecond. Where there
is no compiler, the compile fails, or ``RECSYS_CPU_OPS=0``, :func:`available` is False (the
reason in :func:`unavailable_reason`; a failed compile or load also warns once) and the arena
runs its tensor ops: the loops are a speed path, never a different result.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["ArenaLoops", "available", "find", "touch", "unavailable_reason"]

_SOURCE = Path(__file__).with_name("key_arena_cpu.c")
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_REASON: str | None = None  # why the library is not there (None: not tried yet, or loaded)
_TRIED = False

_I64, _P = ctypes.c_int64, ctypes.c_void_p


def _cache_dir() -> Path:
    root = os.environ.get("RECSYS_CACHE_DIR") or Path.home() / ".cache" / "recsys"
    return Path(root) / "cpu_ops"


def _compile(source: Path, target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, cc or gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent process loads a whole file or builds


def _load() -> ctypes.CDLL | None:
    global _LIB, _REASON, _TRIED
    with _LOCK:
        if _TRIED:
            return _LIB
        _TRIED = True
        if os.environ.get("RECSYS_CPU_OPS", "1") == "0":
            _REASON = "turned off by RECSYS_CPU_OPS=0"
            return None
        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
        target = _cache_dir() / f"key_arena_cpu-{digest}-{platform.machine()}.so"
        try:
            if not target.is_file():
                _compile(_SOURCE, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError) as error:
            _REASON = str(error)
            warnings.warn(
                f"recsys: the key arena's CPU loops are not available ({_REASON}); dynamic "
                "tables on CPU run their tensor ops instead (the same results, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        lib.recsys_arena_find.restype = _I64
        lib.recsys_arena_find.argtypes = [_I64, *[_P] * 8, _I64, _I64, _P, _P, _P]
        lib.recsys_arena_touch.restype = None
        lib.recsys_arena_touch.argtypes = [_I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _P, _I64, _I64]
        lib.recsys_arena_lookup.restype = _I64
        lib.recsys_arena_lookup.argtypes = [
            *lib.recsys_arena_find.argtypes,
            *[_P] * 5,
            _I64,
            _P,
            _I64,
            _I64,
            _P,
        ]
        _LIB = lib
        return lib


def available() -> bool:
    """Whether the compiled loops are loaded (compiling them on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    return None if available() else _REASON


def _library() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"the arena's CPU loops are not available: {_REASON}")
    return lib


def _touch_pointers(hits, last_seen, scores, lfu_mode: int, lfu, scratch: int) -> tuple:
    """The touch loop's arguments from ``hits`` to ``scratch``, checked (see :func:`touch`)."""
    if lfu_mode not in (0, 1, 2):
        raise ValueError(f"lfu_mode is {lfu_mode!r}; expected 0, 1 or 2")
    return (
        _ptr(hits, torch.int64, "hits"),
        _ptr(last_seen, torch.int64, "last_seen"),
        _ptr(scores, torch.int64, "scores"),
        lfu_mode,
        _ptr(lfu, torch.bool, "lfu"),
        scratch,
    )


def _ptr(tensor: torch.Tensor | None, dtype: torch.dtype, name: str) -> int | None:
    """The data pointer of a contiguous CPU tensor of ``dtype`` (None stays None)."""
    if tensor is None:
        return None
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"{name} is a {tensor.dtype} tensor on {tensor.device} (contiguous: "
            f"{tensor.is_contiguous()}); expected a contiguous {dtype} CPU tensor"
        )
    return tensor.data_ptr()


def find(
    ids: torch.Tensor,
    hint_mask: torch.Tensor,
    hint_base: torch.Tensor,
    num_buckets: torch.Tensor,
    first_bucket: torch.Tensor,
    mine: torch.Tensor | None,
    hints: torch.Tensor,
    keys: torch.Tensor,
    bucket_size: int,
    empty_key: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each id's slot in its map of the arena, through its hint, else a scan of its bucket
    (which writes the hint): ``(slot [V], where [U], hint_at [U])`` — ``slot`` -1 where the
    map does not hold the id (and the hinted slot, the scratch, for ids of no table of the
    arena: ``mine`` False; None: every id is the arena's); ``where`` those ids' positions in
    ascending order, ``hint_at`` their hint entries. ``hints`` is updated in place. All int64
    (``mine`` bool) CPU tensors; the entries of ``hints`` must name slots of ``keys`` and the
    per-id bucket ranges lie in ``keys`` (not checked: the arena builds them)."""
    lib = _library()
    n = ids.numel()
    slot = torch.empty(n, dtype=torch.int64)
    where = torch.empty(n, dtype=torch.int64)
    hint_at = torch.empty(n, dtype=torch.int64)
    listed = lib.recsys_arena_find(
        n,
        _ptr(ids, torch.int64, "ids"),
        _ptr(hint_mask, torch.int64, "hint_mask"),
        _ptr(hint_base, torch.int64, "hint_base"),
        _ptr(num_buckets, torch.int64, "num_buckets"),
        _ptr(first_bucket, torch.int64, "first_bucket"),
        _ptr(mine, torch.bool, "mine"),
        _ptr(hints, torch.int64, "hints"),
        _ptr(keys, torch.int64, "keys"),
        bucket_size,
        empty_key,
        slot.data_ptr(),
        where.data_ptr(),
        hint_at.data_ptr(),
    )
    return slot, where[:listed], hint_at[:listed]


def touch(
    target: torch.Tensor,
    live: torch.Tensor | None,
    table: torch.Tensor,
    hits: torch.Tensor | None,
    last_seen: torch.Tensor,
    scores: torch.Tensor,
    lfu: torch.Tensor,
    lfu_mode: int,
    scratch: int,
    step: int,
) -> None:
    """A lookup's update of the slots ``target`` [V] (in place): with ``hits`` [T + 1], each
    table's distinct slots among the ``live`` ids (None: all) added to it; every target's last
    step set to ``step``; its score set to ``step`` (LRU tables) or one more per id (LFU,
    ``lfu`` [T + 1] bool per table), the ids of one kind writing the ``scratch`` slot for the
    other's update, as the arena's tensor ops do. ``lfu_mode``: 0 every table LRU, 1 every
    table LFU, 2 both kinds. ``table`` [V]: each id's arena table. Ids that are not ``live``
    target the ``scratch``; ``step`` is above every slot's last step (steps only grow)."""
    lib = _library()
    lib.recsys_arena_touch(
        target.numel(),
        _ptr(target, torch.int64, "target"),
        _ptr(live, torch.bool, "live"),
        _ptr(table, torch.int64, "table"),
        int(hits is not None),
        *_touch_pointers(hits, last_seen, scores, lfu_mode, lfu, scratch),
        step,
    )


class ArenaLoops:
    """The loops bound to one arena's buffers for the lookups of training steps: the buffers'
    pointers are checked once, here, and the tensors held (the arena binds anew whenever it
    takes new buffers), so a step pays one foreign call instead of two calls that each check a
    dozen tensors.

    Args:
        hints, keys, last_seen, scores: the arena's int64 buffers (updated in place).
        hits: [T + 1] int64, each table's hit count (added to).
        lfu: [T + 1] bool, which tables are LFU; ``lfu_mode`` as in :func:`touch`.
        bucket_size, empty_key, scratch: as in :func:`find` and :func:`touch`.
    """

    def __init__(
        self,
        hints: torch.Tensor,
        keys: torch.Tensor,
        last_seen: torch.Tensor,
        scores: torch.Tensor,
        hits: torch.Tensor,
        lfu: torch.Tensor,
        lfu_mode: int,
        bucket_size: int,
        empty_key: int,
        scratch: int,
    ) -> None:
        self._lookup = _library().recsys_arena_lookup
        self._held = (hints, keys, last_seen, scores, hits, lfu)
        self._arena = (
            _ptr(hints, torch.int64, "hints"),
            _ptr(keys, torch.int64, "keys"),
            bucket_size,
            empty_key,
        )
        self._touch = _touch_pointers(hits, last_seen, scores, lfu_mode, lfu, scratch)

    def columns(
        self,
        hint_mask: torch.Tensor,
        hint_base: torch.Tensor,
        num_buckets: torch.Tensor,
        first_bucket: torch.Tensor,
        mine: torch.Tensor | None,
        table: torch.Tensor,
        base: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor | None, ...], tuple[int | None, ...]]:
        """A batch layout's per-id columns [V] (as in :func:`find`; ``table`` each id's arena
        table, ``base`` its table's first slot), checked once: what :meth:`lookup` takes. The
        caller keeps it only as long as the tensors are not written."""
        held = (hint_mask, hint_base, num_buckets, first_bucket, mine, table, base)
        names = ("hint_mask", "hint_base", "num_buckets", "first_bucket", "mine", "table", "base")
        pointers = tuple(
            _ptr(t, torch.bool if name == "mine" else torch.int64, name)
            for t, name in zip(held, names, strict=True)
        )
        if len({t.numel() for t in held if t is not None}) != 1:
            raise ValueError("the per-id columns differ in length")
        return held, pointers

    def lookup(
        self, ids: torch.Tensor, columns: tuple[tuple, tuple], step: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """:func:`find` of ``ids`` (as laid out by ``columns``, from :meth:`columns`), then,
        when every id of the arena has a slot, :func:`touch` of them at ``step`` (hits counted,
        the ids of no table at the scratch) and each id's row: ``(slot, rows, where,
        hint_at)``. Where ids were listed, ``rows`` is None and nothing was touched; where
        none was, ``slot`` is None (``rows`` took its place)."""
        held, (hint_mask, hint_base, num_buckets, first_bucket, mine, table, base) = columns
        n = ids.numel()
        if held[0].numel() != n:
            raise ValueError(f"{n} ids for per-id columns of {held[0].numel()}")
        ids_at = _ptr(ids, torch.int64, "ids")
        out = torch.empty(3 * n, dtype=torch.int64)  # slots (then rows), where, hint entries
        at = out.data_ptr()
        hints_at, keys_at, bucket_size, empty_key = self._arena
        listed = self._lookup(
            n,
            ids_at,
            hint_mask,
            hint_base,
            num_buckets,
            first_bucket,
            mine,
            hints_at,
            keys_at,
            bucket_size,
            empty_key,
            at,
            at + 8 * n,
            at + 16 * n,
            table,
            base,
            *self._touch,
            step,
            at,
        )
        if listed:
            return out[:n], None, out[n : n + listed], out[2 * n : 2 * n + listed]
        return None, out[:n], out[n:n], out[2 * n : 2 * n]
