"""What every embedding collection tells the rest of recsys, and the walker that finds them.

The trainer (its optimizers, schedule and checkpoint state), ``parallelize`` and fine-tuning
see a collection only through :class:`EmbeddingCollectionInterface` (the role TorchRec's
``EmbeddingBagCollectionInterface`` plays): its table configs, its fused optimizer, the table
parameters a torch optimizer must train, and its state in the **logical layout**, which does
not depend on how (or whether) the collection is sharded:

- ``embedding_bags.<table>.weight``: the whole table, ``[num_embeddings, embedding_dim]``;
- ``embedding_bags.<table>.<state>``: a fused optimizer's state of that table (per row
  ``[num_embeddings]`` or per element, see :attr:`FusedOptimizer.states`);
- ``optimizer_step``: the fused optimizer's step counter.

The unpooled :class:`recsys.EmbeddingCollection` keys its tables ``embeddings.<table>....`` instead
(TorchRec's name, :attr:`EmbeddingCollectionInterface.tables_key`).

A collection whose modules are arranged otherwise inside (a sharded one) re-keys its own state
to this layout; no other module reads the names of a collection's submodules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagConfig

from recsys.embedding.optim import FusedOptimizer

WEIGHT = "weight"
OPTIMIZER_STEP = "optimizer_step"
TABLES = "embedding_bags"
# The unpooled collection's name for them (TorchRec's EmbeddingCollection: ``embeddings``).
UNPOOLED_TABLES = "embeddings"


@dataclass(frozen=True)
class TableDelta:
    """What changed in one dynamic table since its previous delta (see
    :meth:`EmbeddingCollectionInterface.take_delta`).

    Attributes:
        keys: [n] int64, the keys inserted or updated since the previous delta, ascending.
        weights: [n, dim] their rows now.
        last_seen: [n] int64, the step each key was last trained on.
        deleted: [m] int64, ascending: keys that had a row at the previous delta (or got one
            since) and have none now (evicted, expired or removed).
    """

    keys: torch.Tensor
    weights: torch.Tensor
    last_seen: torch.Tensor
    deleted: torch.Tensor


@dataclass(frozen=True)
class SavedState:
    """What a collection may learn of a checkpoint before it is loaded (see
    :meth:`EmbeddingCollectionInterface.load_targets`).

    Attributes:
        shapes: every key the checkpoint holds (full, e.g. ``"model.sparse_arch.x"``) with its
            shape (None: a plain value).
        prefix: what the checkpoint's keys of this collection have before the collection's own.
        read: reads small tensors by full key, whole (a collective: every rank asks for the
            same keys); None where the checkpoint cannot be read ahead.
    """

    shapes: dict[str, torch.Size | None]
    prefix: str
    read: Callable[[list[str]], dict[str, torch.Tensor]] | None = None

    def shape(self, key: str) -> torch.Size | None:
        """The saved shape of the collection's ``key`` (None: not saved, or a plain value)."""
        return self.shapes.get(self.prefix + key)


class EmbeddingCollectionInterface(nn.Module):
    """Base class of recsys' embedding collections (plain, sharded, and the kinds to come).

    ``forward(KeyedJaggedTensor) -> KeyedTensor`` pools every feature's bags, and
    ``state_dict()`` is in the logical layout of the module docstring. Subclasses set
    :attr:`optimizer` and implement :meth:`embedding_bag_configs`, :meth:`is_weighted` and,
    when their parameters are not the logical tables, :meth:`trainable_parameters`,
    :meth:`ddp_parameters` and :meth:`logical_optimizer_state`.
    """

    #: The fused optimizer applied inside backward (None: tables take dense gradients, or are
    #: frozen).
    optimizer: FusedOptimizer | None = None

    #: What the tables' state keys start with: ``embedding_bags`` (pooled collections) or
    #: ``embeddings`` (the unpooled EmbeddingCollection), as in TorchRec.
    tables_key: str = TABLES

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The logical tables, in output order."""
        raise NotImplementedError

    def is_weighted(self) -> bool:
        """Whether inputs carry a weight per id."""
        raise NotImplementedError

    def set_optimizer(self, optimizer: FusedOptimizer | None) -> None:
        """Fuse ``optimizer`` into backward from now on (None: dense gradients, or frozen).

        Raises:
            ValueError: this kind takes its optimizer when it is built.
        """
        raise ValueError(
            f"a {type(self).__name__} takes its fused optimizer when it is built; set the "
            "optimizer (or freeze the tables) on the unsharded collection before sharding it"
        )

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Table parameters a torch optimizer must train: none under a fused optimizer or when
        the tables are frozen."""
        if self.optimizer is not None:
            return []
        return [p for p in self.parameters() if p.requires_grad]

    def ddp_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients DistributedDataParallel must average (replicated tables
        trained by a torch optimizer); the rest of the collection is DDP's to ignore."""
        return []

    def communication_seconds(self) -> float:
        """Seconds this collection has spent in collectives so far (0 for one that
        communicates nothing): the step-time breakdown's ``collectives``."""
        return 0.0

    def is_frozen(self) -> bool:
        """Trained neither by a fused update nor by gradients."""
        return self.optimizer is None and not any(p.requires_grad for p in self.parameters())

    def logical_optimizer_state(self, prefix: str, state: dict[str, Any]) -> dict[str, Any]:
        """A torch optimizer's per-parameter state (keyed by parameter name, this collection's
        under ``prefix``) with this collection's entries re-keyed to the logical tables
        (``<prefix>embedding_bags.<table>.weight``), in logical shapes; other entries are
        returned as they are. The plain collection's parameters are the logical tables."""
        return state

    def live_keys(self, name: str) -> torch.Tensor | None:
        """The ids table ``name`` holds a row for, ascending, when it maps raw ids to rows (a
        dynamic table: the keys it holds now); None for a fixed table, whose ids are its rows
        ``0 .. num_embeddings - 1``."""
        return None

    def dynamic_stats(self) -> dict[str, dict[str, float]]:
        """Counters of each table that maps raw ids to rows, by table (none for fixed
        tables): the trainer logs them at every train event."""
        return {}

    def take_delta(self) -> dict[str, TableDelta]:
        """Per dynamic table this process holds (a sharded collection: its own keys), what
        changed since the previous call (or since the collection was built or loaded); the
        next call starts from now. Empty for fixed tables."""
        return {}

    def variable_state_keys(self) -> list[str]:
        """State keys (relative to the collection) whose size changes as the collection
        trains (a dynamic table's keys and rows): a checkpoint of them is loaded into tensors
        of its own sizes (see :func:`state_to_load`). None for fixed tables."""
        return []

    def load_targets(self, state: dict[str, Any], saved: SavedState, prefix: str) -> None:
        """Make ``state`` (the model's state dict; this collection's keys under ``prefix``)
        ready to load a checkpoint into: each :meth:`variable_state_keys` entry becomes an
        empty tensor of the saved size, or is dropped where the checkpoint lacks it."""
        for key in self.variable_state_keys():
            if prefix + key not in state:
                continue
            shape = saved.shape(key)
            if shape is None:
                del state[prefix + key]
                continue
            live = state[prefix + key]
            state[prefix + key] = torch.empty(tuple(shape), dtype=live.dtype, device=live.device)

    def weight_keys(self) -> list[str]:
        """The state keys of the table weights (relative to the collection)."""
        return [f"{self.tables_key}.{c.name}.{WEIGHT}" for c in self.embedding_bag_configs()]

    def is_optimizer_state_key(self, key: str) -> bool:
        """Whether state key ``key`` (relative to the collection) is fused optimizer state, in
        this collection or in a checkpoint of it saved with a fused optimizer."""
        if key == OPTIMIZER_STEP:
            return True
        parts = key.split(".")
        names = {c.name for c in self.embedding_bag_configs()}
        return (
            len(parts) == 3
            and parts[0] == self.tables_key
            and parts[1] in names
            and parts[2] != WEIGHT
        )


def is_optimizer_state(key: str) -> bool:
    """Whether a model state key (full, with the collection's path) has the shape of fused
    optimizer state in the logical layout: ``...optimizer_step`` or
    ``...embedding_bags.<table>.<state>`` (or ``...embeddings.<table>.<state>``) other than
    ``weight``. For keys of a checkpoint, whose collections and tables the current model may
    not have."""
    parts = key.split(".")
    if parts[-1] == OPTIMIZER_STEP:
        return True
    return len(parts) >= 3 and parts[-3] in (TABLES, UNPOOLED_TABLES) and parts[-1] != WEIGHT


def embedding_collections(model: nn.Module) -> dict[str, EmbeddingCollectionInterface]:
    """Every embedding collection of ``model`` by module path (``""`` for the model itself),
    in module order; the collections a collection holds inside (a sharded collection's local
    shards) are its own business and not listed."""
    found: dict[str, EmbeddingCollectionInterface] = {}
    for path, module in model.named_modules():
        inside = any(path.startswith(f"{outer}.") or outer == "" for outer in found)
        if isinstance(module, EmbeddingCollectionInterface) and not inside:
            found[path] = module
    return found


def state_prefix(path: str) -> str:
    """The prefix of a module's keys in its model's state dict."""
    return f"{path}." if path else ""


def logical_optimizer_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer's per-parameter ``state`` over ``model`` with every collection's
    entries in the logical table layout (see :meth:`~EmbeddingCollectionInterface.
    logical_optimizer_state`): what a checkpoint stores, whatever the sharding."""
    for path, collection in embedding_collections(model).items():
        state = collection.logical_optimizer_state(state_prefix(path), state)
    return state


def state_to_load(
    model: nn.Module,
    saved_shapes: dict[str, torch.Size | None],
    prefix: str = "",
    read: Callable[[list[str]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """``model.state_dict()`` to load a checkpoint into: each collection's variable-size
    entries made to the checkpoint's sizes (see
    :meth:`~EmbeddingCollectionInterface.load_targets`); ``model.load_state_dict`` then takes
    them.

    Args:
        model: the model being loaded.
        saved_shapes: the checkpoint's keys and shapes (``checkpoint_shapes``).
        prefix: what the checkpoint's keys have before the model's (``"model."``).
        read: reads small tensors of the checkpoint by key (what a sharded dynamic table needs
            to know before loading: its keys per routing bucket).
    """
    state = model.state_dict()
    for path, collection in embedding_collections(model).items():
        where = state_prefix(path)
        collection.load_targets(state, SavedState(saved_shapes, prefix + where, read), where)
    return state


def variable_state_keys(model: nn.Module) -> set[str]:
    """The model's state keys (full) whose size changes as it trains (see
    :meth:`~EmbeddingCollectionInterface.variable_state_keys`)."""
    return {
        state_prefix(path) + key
        for path, collection in embedding_collections(model).items()
        for key in collection.variable_state_keys()
    }
