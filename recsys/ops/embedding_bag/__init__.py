"""The table-batched embedding bag and the row updates of its fused optimizers.

- ``pooled.py``: the op: reference, validation, autograd, backend dispatch.
- ``lookup.py``: the unpooled lookup (one row per id) on the same packed buffers.
- ``layout.py``: the packed buffer layout, the typed lookup plan, the optimizer codes.
- ``checks.py``: the device-side input checks.
- ``cpu.py``: the torch and FBGEMM-CPU paths; ``triton_kernels.py``: the Triton kernels.
- ``row_update.py``: a fused optimizer applied to some rows, in PyTorch.

``recsys.ops.embedding_bag`` re-exports the op's public names (its import path before the
package).
"""

from recsys.ops.embedding_bag.pooled import (
    FusedUpdate,
    LookupPlan,
    TableLayout,
    check_on_device,
    choose_backend,
    embedding_bag,
    embedding_bag_reference,
    rounding_seed,
    stochastic_round,
    table_batched_embedding_bag,
    update_rows,
    validate_inputs,
)

__all__ = [
    "FusedUpdate",
    "LookupPlan",
    "TableLayout",
    "check_on_device",
    "choose_backend",
    "embedding_bag",
    "embedding_bag_reference",
    "rounding_seed",
    "stochastic_round",
    "table_batched_embedding_bag",
    "update_rows",
    "validate_inputs",
]
