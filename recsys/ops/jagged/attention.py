"""HSTU pointwise attention on jagged sequences (Zhai et al. 2024, "Actions Speak Louder than
Words"), forward and backward.

Math. A batch holds B sequences back to back: q, k [T, H, Dqk], v [T, H, Dv] with
T = sum n_b, sequence b in rows ``offsets[b] .. offsets[b + 1]`` (``offsets`` [B + 1]). Per
sequence and head, for positions i, j < n:

    s_ij = alpha * q_i . k_j
    y_i  = (1 / N) * sum_j  mask(i, j) * silu(s_ij) * v_j                  silu(x) = x sigmoid(x)

with N = ``max_seq_len`` (one normalizer for the batch, as Meta's generative-recommenders
does). ``mask(i, j)`` says which keys a query sees. With h = n - t_b the history length
(``num_targets`` t_b, default 0), c = ``contextual_len`` (0 <= c <= h), w = ``max_attn_len``
(0: no window) and m = ``min_full_attn_seq_len``, row p of a sequence sits at position

    u_p = min(max(p, c - 1), h)

(the contextual prefix collapses to one position, c - 1, and every target sits at h, just after
the history), and for i, j < n

    mask(i, j) = (causal(i, j) and near(i, j))  or  (i < c and j < h)
    causal(i, j) = i = j  or  u_i > u_j
    near(i, j)   = w = 0  or  u_i - u_j <= w  or  (m > 0 and u_i >= h - m)

In words: causal over the history; a target sees the history and itself, not the other
targets; a window keeps the keys at most w positions back (w = 1: the previous key and the
diagonal), measured from u, so a non-prefix query sees the prefix's keys while u_i - (c - 1) <= w
and a target's window ends at the history's end (its output does not depend on its slot among
the targets); with a window, the rows at u_i >= h - m (the last m history rows and every
target) ignore it; the prefix's rows see the whole history (not the targets), window or not.

This is Meta's definition: ``_get_valid_attn_mask`` in
generative-recommenders' ``generative_recommenders/ops/pytorch/pt_hstu_attention.py`` (their
ids are u - max(c - 1, 0): ``ids - contextual_seq_len + 1`` clamped at 0, targets clamped to
``max_ids``; ``eye | row_col_dist > 0``, ``row_col_dist <= max_attn_len`` or
``row_ids >= max_ids - min_full_attn_seq_len``, and ``row_ids == 0 and col_ids < max_ids``),
which their Triton kernel (``ops/triton/triton_hstu_attention.py``,
``_hstu_attn_fwd_one_block``) computes the same way. Where recsys offers more: its Triton
path takes ``min_full_attn_seq_len`` (Meta's Triton kernel asserts it is 0), the relative bias
below is fused into its forward and backward (Meta's current kernels take none), and the time
bias has the ``"own"`` convention besides Meta's. Meta has, and recsys does not: non-causal
attention, attention dropout, ``attn_scale`` and cached (delta) queries.

Relative attention bias (optional; Meta's ``RelativeBucketedTimeAndPositionBasedBias``, fused
into the kernel like their ragged HSTU attention was): s_ij = alpha q_i . k_j + rab_ij, one
bias for all heads, the sum of any of

- position: ``position_weights[clamp(u_j - u_i + P - 1, 0, 2P - 2)]`` with the table of
  2P - 1 entries and u the positions of the mask (every target at h, the prefix at c - 1):
  differences beyond P - 1 share the end rows. This is Meta's fused relative-bias kernel
  (generative-recommenders' ``generative_recommenders/ops/triton/
  triton_ragged_hstu_attention.py``, ``offs_pos_w`` from ``offs_n_minus_m`` of the clamped
  ids, ``max_pos_ind`` = P; their commit 472bc98 of December 2024 replaced it with
  ``triton_hstu_attention.py``, which has no bias); their research model's
  ``RelativePositionalBias`` is the case without targets and prefix;
- time: ``time_weights[clamp(floor(log(max(|tau_i - t_j|, 1e-6) / incr) / div), 0, K)]``
  with ``timestamps`` t [T] (float64 in every path), K + 1 table entries, ``incr`` =
  ``time_bucket_incr`` and ``div`` = ``time_bucket_div`` (taken as float32 values). The
  defaults (1 s, 0.301) are the research HSTU's ``log(max(|dt|, 1)) / 0.301`` (the same
  buckets), 128 buckets in its recipes. The query's time tau_i is, by ``time_convention``:

  - ``"own"`` (the default): tau_i = t_i, the query's own event (recsys's convention: a
    sequence's last row needs no later time, which serving does not have);
  - ``"next"``: tau_i = t_(i+1), the next row's time (the event row i predicts), and
    tau_(n-1) = t_(n-1) for a sequence's last row: Meta's causal
    ``RelativeBucketedTimeAndPositionBasedBias`` (``generative_recommenders/research/
    modeling/sequential/hstu.py``: ``ext_timestamps = torch.cat([all_timestamps,
    all_timestamps[:, N - 1 : N]], dim=1)``, buckets of ``ext_timestamps[:, 1:].unsqueeze(2)
    - ext_timestamps[:, :-1].unsqueeze(1)``) and their fused kernel (``ts_0`` loaded at
    ``offs_m + 1`` when ``CAUSAL``). For a last row Meta reads slot n of its padded
    timestamps: a copy of the row's own time when the sequence fills the buffer (what recsys
    uses for every sequence), the held-out target's time in their research data, which
    writes it there; a jagged batch has no slot n. Meta reads t_(i+1) for targets too, and so
    does recsys: the history's last row takes the first target's time and a target the next
    one's, so targets of different times make the outputs depend on their order (give a
    request's targets one time, or use ``"own"``).

  Shifting ``timestamps`` does not turn one convention into the other: the keys' times move
  with the queries'.

The tables' gradients: dz_ij below, summed over heads and over the (i, j) sharing a row.

No softmax: the weights are pointwise, so nothing is normalized across keys and the backward
needs no row statistics. With g = dy and sig = sigmoid(s):

    dv_j = (1 / N) sum_i mask * silu(s_ij) g_i
    dz_ij = mask * (1 / N) (g_i . v_j) * sig (1 + s (1 - sig))
    dq_i = alpha sum_j dz_ij k_j      dk_j = alpha sum_i dz_ij q_i     d rab_ij = dz_ij

Shape letters: T total rows, B sequences, H heads, Dqk / Dv head dims, N ``max_seq_len``
(>= the longest sequence).

Paths: :func:`jagged_attention_reference` loops over sequences in float64 (the test oracle);
the torch path pads the batch to [B, N] and computes the [B, H, N, N] weights (autograd
through torch ops); the Triton path never forms them: the forward takes one program per
(query tile, sequence x head) and loops over key tiles up to the causal bound, the backward
one program per key tile (dk, dv, looping over queries) and one per query tile (dq, looping
over keys), recomputing s and the bias (``recsys.ops.jagged.attention_triton``).
Deterministic, except the bias tables' gradients on the Triton path (summed with atomics:
run-to-run differences in the last bits). Dtypes fp32 / bf16 / fp16 (one for q, k, v), fp32
accumulation, output in the input dtype; fp64 runs on the torch path. Bias tables are read as
float32 by the kernels.
"""

from __future__ import annotations

import torch

from recsys.ops._triton import autocast_inputs, resolve_backend
from recsys.ops.jagged.attention_triton import JaggedAttentionFunction

__all__ = [
    "TIME_CONVENTIONS",
    "jagged_attention",
    "jagged_attention_reference",
    "query_times",
    "relative_bias",
    "visible",
]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TIME_CONVENTIONS = ("own", "next")
"""``time_convention`` values: the query's own time, or the next row's (module docstring)."""


def sequence_position(p: torch.Tensor, history: torch.Tensor, contextual_len: int) -> torch.Tensor:
    """u_p of the module docstring: row ``p``'s position, the contextual prefix collapsed to
    c - 1 and the targets pinned at the history's end (elementwise, broadcasting)."""
    return torch.minimum(p.clamp(min=contextual_len - 1), history)


def visible(
    i: torch.Tensor,
    j: torch.Tensor,
    n: torch.Tensor,
    history: torch.Tensor,
    contextual_len: int,
    max_attn_len: int,
    min_full_attn_seq_len: int = 0,
) -> torch.Tensor:
    """``mask(i, j)`` of the module docstring, elementwise (broadcasting), for sequences of
    ``n`` rows whose first ``history`` rows are history."""
    u_i = sequence_position(i, history, contextual_len)
    u_j = sequence_position(j, history, contextual_len)
    seen = (i == j) | (u_i > u_j)
    if max_attn_len > 0:
        near = u_i - u_j <= max_attn_len
        if min_full_attn_seq_len > 0:
            near = near | (u_i >= history - min_full_attn_seq_len)
        seen = seen & near
    if contextual_len > 0:
        seen = seen | ((i < contextual_len) & (j < history))
    return (i < n) & (j < n) & seen


def query_times(times: torch.Tensor, lengths: torch.Tensor, time_convention: str) -> torch.Tensor:
    """tau of the module docstring for the rows' times ``times`` [..., N] of sequences of
    ``lengths`` [...] rows (rows past a sequence's end get its last row's time)."""
    if time_convention == "own":
        return times
    steps = torch.arange(times.shape[-1], device=times.device)
    following = torch.minimum(steps + 1, (lengths - 1).clamp(min=0)[..., None])
    return times.gather(-1, following.expand(times.shape))


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def relative_bias(
    i: torch.Tensor,
    j: torch.Tensor,
    history: torch.Tensor,
    contextual_len: int,
    t_i: torch.Tensor | None,
    t_j: torch.Tensor | None,
    position_weights: torch.Tensor | None,
    time_weights: torch.Tensor | None,
    time_bucket_incr: float = 1.0,
    time_bucket_div: float = 0.301,
) -> torch.Tensor | float:
    """``rab(i, j)`` of the module docstring, elementwise (broadcasting): rows ``i``, ``j``,
    history length ``history``, the prefix's ``contextual_len``, float64 times ``t_i``,
    ``t_j`` (used only with ``time_weights``). 0.0 without tables."""
    bias: torch.Tensor | float = 0.0
    if position_weights is not None:
        reach = (position_weights.numel() + 1) // 2  # P
        gap = sequence_position(j, history, contextual_len) - sequence_position(
            i, history, contextual_len
        )
        bias = position_weights[(gap + reach - 1).clamp(0, 2 * reach - 2)]
    if time_weights is not None:
        gap = (t_i - t_j).abs().clamp(min=1e-6)
        scaled = torch.log(gap / _float32(time_bucket_incr)) / _float32(time_bucket_div)
        bucket = scaled.clamp(0, time_weights.numel() - 1).long()  # floor: scaled >= 0
        bias = bias + time_weights[bucket]
    return bias


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    max_attn_len: int,
    min_full_attn_seq_len: int,
) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q and k "
            "[T, H, Dqk] and v [T, H, Dv]"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must agree")
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets {tuple(offsets.shape)} {offsets.dtype}: expected int [B + 1]")
    sizes = dict(
        max_seq_len=max_seq_len,
        contextual_len=contextual_len,
        max_attn_len=max_attn_len,
        min_full_attn_seq_len=min_full_attn_seq_len,
    )
    if min(sizes.values()) < 0:
        named = ", ".join(f"{name}={value}" for name, value in sizes.items())
        raise ValueError(f"{named}: expected >= 0")
    batch = offsets.numel() - 1
    if num_targets is not None and (num_targets.dim() != 1 or num_targets.numel() != batch):
        raise ValueError(f"num_targets {tuple(num_targets.shape)}: expected one per sequence")


def _check_bias(
    q: torch.Tensor,
    timestamps: torch.Tensor | None,
    position_weights: torch.Tensor | None,
    time_weights: torch.Tensor | None,
    time_bucket_incr: float,
    time_bucket_div: float,
    time_convention: str,
) -> None:
    if time_convention not in TIME_CONVENTIONS:
        raise ValueError(f"time_convention={time_convention!r}: expected one of {TIME_CONVENTIONS}")
    if position_weights is not None and (
        position_weights.dim() != 1 or position_weights.numel() % 2 == 0
    ):
        raise ValueError(
            f"position_weights {tuple(position_weights.shape)}: expected [2P - 1], an odd length"
        )
    if time_weights is None:
        return
    if time_weights.dim() != 1 or time_weights.numel() < 1:
        raise ValueError(
            f"time_weights {tuple(time_weights.shape)}: expected [num_time_buckets + 1]"
        )
    if timestamps is None or timestamps.shape != q.shape[:1]:
        shape = None if timestamps is None else tuple(timestamps.shape)
        raise ValueError(f"timestamps {shape}: the time bias needs one per row, [{q.shape[0]}]")
    if not time_bucket_incr > 0 or not time_bucket_div > 0:
        raise ValueError(
            f"time_bucket_incr={time_bucket_incr}, time_bucket_div={time_bucket_div}: "
            "expected > 0"
        )


def _check_lengths(
    offsets: torch.Tensor, max_seq_len: int, num_targets, contextual_len: int
) -> None:
    lengths = offsets.diff()
    if offsets.numel() and int(offsets[0]) != 0:
        raise ValueError(f"offsets[0] = {int(offsets[0])}; expected 0")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"offsets decrease at sequence {int(lengths.argmin())}")
    if lengths.numel() and int(lengths.max()) > max_seq_len:
        raise ValueError(
            f"sequence {int(lengths.argmax())} has {int(lengths.max())} rows; max_seq_len is "
            f"{max_seq_len}"
        )
    if num_targets is not None and num_targets.numel():
        bad = (num_targets < 0) | (num_targets > lengths)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"num_targets[{b}] = {int(num_targets[b])}; sequence {b} has {int(lengths[b])} rows"
            )
    if contextual_len > 0 and lengths.numel():
        # an empty sequence has no rows to mask; any other holds the prefix in its history
        history = lengths if num_targets is None else lengths - num_targets
        bad = (lengths > 0) & (history < contextual_len)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"contextual_len = {contextual_len}; sequence {b} has {int(lengths[b])} rows, "
                f"{int(history[b])} of them history: the contextual prefix must fit in the "
                "history"
            )


def jagged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    *,
    alpha: float = 1.0,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    max_attn_len: int = 0,
    min_full_attn_seq_len: int = 0,
    timestamps: torch.Tensor | None = None,
    position_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    time_bucket_incr: float = 1.0,
    time_bucket_div: float = 0.301,
    time_convention: str = "own",
) -> torch.Tensor:
    """The module docstring's y, one sequence at a time in float64 (returned as float64;
    differentiable in q, k, v and the bias tables)."""
    masking = (contextual_len, max_attn_len, min_full_attn_seq_len)
    _check(q, k, v, offsets, max_seq_len, num_targets, *masking)
    bucketing = (time_bucket_incr, time_bucket_div)
    _check_bias(q, timestamps, position_weights, time_weights, *bucketing, time_convention)
    tables = [w.double() if w is not None else None for w in (position_weights, time_weights)]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    bounds = offsets.tolist()
    targets = [0] * (len(bounds) - 1) if num_targets is None else num_targets.tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        n = end - start
        qb, kb, vb = (x[start:end].double().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        history = torch.tensor(n - targets[b])
        times = timestamps[start:end].double() if timestamps is not None else None
        t_i, t_j = None, None
        if times is not None:
            t_i = query_times(times, torch.tensor(n), time_convention)[:, None]
            t_j = times[None, :]
        bias = relative_bias(i, j, history, contextual_len, t_i, t_j, *tables, *bucketing)
        s = alpha * qb @ kb.transpose(1, 2) + bias  # [H, n, n]
        mask = visible(i, j, torch.tensor(n), history, *masking)
        weights = torch.where(mask, torch.nn.functional.silu(s), 0.0) / max(max_seq_len, 1)
        out[start:end] = (weights @ vb).transpose(0, 1)
    return out


def _padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    max_attn_len: int,
    min_full_attn_seq_len: int,
    timestamps: torch.Tensor | None,
    position_weights: torch.Tensor | None,
    time_weights: torch.Tensor | None,
    time_bucket_incr: float,
    time_bucket_div: float,
    time_convention: str,
) -> torch.Tensor:
    """The torch path: the batch padded to [B, N], weights [B, H, N, N]."""
    total, heads = q.shape[:2]
    batch, length = offsets.numel() - 1, max(max_seq_len, 1)
    offsets = offsets.long()
    lengths = offsets.diff()
    row = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths, output_size=total)
    col = torch.arange(total, device=q.device) - offsets[:-1][row]

    def pad(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(batch, length, heads, x.shape[2]).index_put((row, col), x)

    qp, kp, vp = (pad(x).transpose(1, 2) for x in (q, k, v))  # [B, H, N, D]
    s = alpha * qp @ kp.transpose(2, 3)  # [B, H, N, N]
    steps = torch.arange(length, device=q.device)
    targets = torch.zeros_like(lengths) if num_targets is None else num_targets.long()
    if position_weights is not None or time_weights is not None:
        times = t_i = None
        if time_weights is not None:
            times = (
                timestamps.double()
                .new_zeros(batch, length)
                .index_put((row, col), timestamps.double())
            )  # [B, N]
            t_i = query_times(times, lengths, time_convention)[:, :, None]
        bias = relative_bias(
            steps[None, :, None],
            steps[None, None, :],
            (lengths - targets)[:, None, None],
            contextual_len,
            t_i,
            times[:, None, :] if times is not None else None,
            position_weights,
            time_weights,
            time_bucket_incr,
            time_bucket_div,
        )  # [B, N, N]
        s = s + bias[:, None].to(s.dtype)
    mask = visible(
        steps[None, :, None],
        steps[None, None, :],
        lengths[:, None, None],
        (lengths - targets)[:, None, None],
        contextual_len,
        max_attn_len,
        min_full_attn_seq_len,
    )  # [B, N, N]
    weights = torch.where(mask[:, None], torch.nn.functional.silu(s), 0.0) / length
    return (weights @ vp).transpose(1, 2)[row, col]  # [T, H, Dv]


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    *,
    alpha: float = 1.0,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    max_attn_len: int = 0,
    min_full_attn_seq_len: int = 0,
    timestamps: torch.Tensor | None = None,
    position_weights: torch.Tensor | None = None,
    time_weights: torch.Tensor | None = None,
    time_bucket_incr: float = 1.0,
    time_bucket_div: float = 0.301,
    time_convention: str = "own",
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """HSTU pointwise attention (see the module docstring): y [T, H, Dv] in q's dtype.

    Args:
        q, k: [T, H, Dqk]; v: [T, H, Dv]; one dtype.
        offsets: int [B + 1], the sequences' row ranges (``offsets[0] = 0``).
        max_seq_len: N, the normalizer and the longest sequence (host-known).
        alpha: the scale of q . k.
        num_targets: int [B], targets at the end of each sequence (None: none).
        contextual_len: rows of each sequence's contextual prefix (at most its history).
        max_attn_len: the local window, keys at most this many positions back (0: none).
        min_full_attn_seq_len: with a window, the last rows of the history (and the targets)
            that attend without it (0: none; Meta's option of that name).
        timestamps: [T] event times (any real dtype, used as float64), needed by the time bias.
        position_weights: [2P - 1] the position bias table (None: no position bias).
        time_weights: [num_time_buckets + 1] the time bias table (None: no time bias).
        time_bucket_incr / time_bucket_div: the time bucketing (module docstring).
        time_convention: the query's time in the time bias: ``"own"`` (its own event's) or
            ``"next"`` (the next row's, Meta's; module docstring).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).
        validate: check on the host that no sequence is longer than ``max_seq_len``, that
            the targets fit in their sequences and the contextual prefix in the history of
            every non-empty sequence (a read of the device). A caller that knows it (a batch
            carrying its longest sequence) passes False; a longer sequence is then not
            attended past ``max_seq_len``, and a prefix longer than a history gets an
            unspecified mask.

    Raises:
        ValueError: shapes, dtypes or settings that do not fit (named), or a backend that
            cannot run here.
    """
    masking = (contextual_len, max_attn_len, min_full_attn_seq_len)
    _check(q, k, v, offsets, max_seq_len, num_targets, *masking)
    bucketing = (_float32(time_bucket_incr), _float32(time_bucket_div))
    _check_bias(q, timestamps, position_weights, time_weights, *bucketing, time_convention)
    if time_weights is None:
        timestamps = None
    if validate:
        _check_lengths(offsets, max_seq_len, num_targets, contextual_len)
    unsupported = "" if q.dtype in TRITON_DTYPES else f"dtype {q.dtype}"
    chosen = resolve_backend(
        backend, q.device, op="jagged_attention", has_triton=True, triton_unsupported=unsupported
    )
    if chosen == "triton" and unsupported:
        raise ValueError(f"jagged_attention's Triton kernels take {TRITON_DTYPES}, not {q.dtype}")
    bias = (timestamps, position_weights, time_weights, *bucketing, time_convention)
    settings = (max_seq_len, alpha, num_targets, *masking, *bias)
    if chosen == "torch":
        return _padded(q, k, v, offsets, *settings)
    q, k, v = autocast_inputs(q, k, v)
    with torch.autocast("cuda", enabled=False):
        return JaggedAttentionFunction.apply(q, k, v, offsets, *settings)
