"""HSTU pointwise attention on jagged sequences (Zhai et al. 2024, "Actions Speak Louder than
Words"), forward and backward.

Math. A batch holds B sequences back to back: q, k [T, H, Dqk], v [T, H, Dv] with
T = sum n_b, sequence b in rows ``offsets[b] .. offsets[b + 1]`` (``offsets`` [B + 1]). Per
sequence and head, for positions i, j < n:

    s_ij = alpha * q_i . k_j
    y_i  = (1 / N) * sum_j  mask(i, j) * silu(s_ij) * v_j                  silu(x) = x sigmoid(x)

with N = ``max_seq_len`` (one normalizer for the batch, as Meta's generative-recommenders
does). ``mask(i, j)`` says which keys a query sees; with h = n - t_b the history length
(``num_targets`` t_b, default 0), c = ``contextual_len`` and w = ``max_attn_len`` (0: none):

- keys of the contextual prefix (j < c) are seen by every query;
- otherwise a history query (i < h) sees j <= i (causal), and a target query (i >= h) sees the
  history (j < h) and itself (j = i), not the other targets;
- with w > 0, additionally i - j < w (the prefix is exempt).

No softmax: the weights are pointwise, so nothing is normalized across keys and the backward
needs no row statistics. With g = dy and sig = sigmoid(s):

    dv_j = (1 / N) sum_i mask * silu(s_ij) g_i
    ds_ij = mask * (1 / N) (g_i . v_j) * sig (1 + s (1 - sig)) * alpha
    dq_i = sum_j ds_ij k_j            dk_j = sum_i ds_ij q_i

Shape letters: T total rows, B sequences, H heads, Dqk / Dv head dims, N ``max_seq_len``
(>= the longest sequence).

Paths: :func:`jagged_attention_reference` loops over sequences in float64 (the test oracle);
the torch path pads the batch to [B, N] and computes the [B, H, N, N] weights (autograd
through torch ops); the Triton path never forms them: the forward takes one program per
(query tile, sequence x head) and loops over key tiles up to the causal bound, the backward
one program per key tile (dk, dv, looping over queries) and one per query tile (dq, looping
over keys), recomputing s (``recsys.ops.jagged_attention_triton``). Deterministic: no
atomics. Dtypes fp32 / bf16 / fp16 (one for q, k, v), fp32 accumulation, output in the input
dtype; fp64 runs on the torch path.

Not yet: the relative attention bias (bucketed position and time differences).
"""

from __future__ import annotations

import torch

from recsys.ops._triton import autocast_inputs, resolve_backend
from recsys.ops.jagged_attention_triton import JaggedAttentionFunction

__all__ = ["jagged_attention", "jagged_attention_reference", "visible"]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def visible(
    i: torch.Tensor,
    j: torch.Tensor,
    n: torch.Tensor,
    history: torch.Tensor,
    contextual_len: int,
    max_attn_len: int,
) -> torch.Tensor:
    """``mask(i, j)`` of the module docstring, elementwise (broadcasting), for sequences of
    ``n`` rows whose first ``history`` rows are history."""
    inside = (i < n) & (j < n)
    causal = torch.where(i < history, j <= i, (j < history) | (j == i))
    if max_attn_len > 0:
        causal = causal & (i - j < max_attn_len)
    return inside & ((j < contextual_len) | causal)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    max_attn_len: int,
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
    if max_seq_len < 0 or contextual_len < 0 or max_attn_len < 0:
        raise ValueError(
            f"max_seq_len={max_seq_len}, contextual_len={contextual_len}, max_attn_len="
            f"{max_attn_len}: expected >= 0"
        )
    batch = offsets.numel() - 1
    if num_targets is not None and (num_targets.dim() != 1 or num_targets.numel() != batch):
        raise ValueError(f"num_targets {tuple(num_targets.shape)}: expected one per sequence")


def _check_lengths(offsets: torch.Tensor, max_seq_len: int, num_targets) -> None:
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
) -> torch.Tensor:
    """The module docstring's y, one sequence at a time in float64 (returned as float64)."""
    _check(q, k, v, offsets, max_seq_len, num_targets, contextual_len, max_attn_len)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    bounds = offsets.tolist()
    targets = [0] * (len(bounds) - 1) if num_targets is None else num_targets.tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        n = end - start
        qb, kb, vb = (x[start:end].double().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        s = alpha * qb @ kb.transpose(1, 2)  # [H, n, n]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        mask = visible(
            i, j, torch.tensor(n), torch.tensor(n - targets[b]), contextual_len, max_attn_len
        )
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
    mask = visible(
        steps[None, :, None],
        steps[None, None, :],
        lengths[:, None, None],
        (lengths - targets)[:, None, None],
        contextual_len,
        max_attn_len,
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
        contextual_len: rows of each sequence's contextual prefix.
        max_attn_len: the local window (0: none).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see ``recsys.ops._triton``).
        validate: check on the host that no sequence is longer than ``max_seq_len`` and that
            targets and prefix fit in their sequences (a read of the device). A caller that
            knows it (a batch carrying its longest sequence) passes False; a longer sequence
            is then not attended past ``max_seq_len``.

    Raises:
        ValueError: shapes, dtypes or settings that do not fit (named), or a backend that
            cannot run here.
    """
    _check(q, k, v, offsets, max_seq_len, num_targets, contextual_len, max_attn_len)
    if validate:
        _check_lengths(offsets, max_seq_len, num_targets)
    unsupported = "" if q.dtype in TRITON_DTYPES else f"dtype {q.dtype}"
    chosen = resolve_backend(
        backend, q.device, op="jagged_attention", has_triton=True, triton_unsupported=unsupported
    )
    if chosen == "triton" and unsupported:
        raise ValueError(f"jagged_attention's Triton kernels take {TRITON_DTYPES}, not {q.dtype}")
    settings = (max_seq_len, alpha, num_targets, contextual_len, max_attn_len)
    if chosen == "torch":
        return _padded(q, k, v, offsets, *settings)
    q, k, v = autocast_inputs(q, k, v)
    with torch.autocast("cuda", enabled=False):
        return JaggedAttentionFunction.apply(q, k, v, offsets, *settings)
