"""Table configs of the model zoo: one table per categorical feature, and the dimension-1 twins
that hold a first-order ("linear", "wide") term.

Plain arguments in, torchrec ``EmbeddingBagConfig`` out: where the names and cardinalities come
from (a dataset's spec, a config) is the caller's business.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchrec import EmbeddingBagConfig

from recsys.embedding.tables import DATA_TYPE_NAMES, POOLING_NAMES


def table_configs(
    feature_names: Sequence[str],
    cardinalities: Sequence[int],
    embedding_dim: int,
    pooling: str = "sum",
    dtype: str = "fp32",
) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, named ``t_<feature>``, sized by its cardinality.

    Args:
        feature_names: the F categorical features (the KJT keys).
        cardinalities: number of distinct ids of each feature (its table's rows).
        embedding_dim: D, the dimension of every table.
        pooling: ``"sum"`` or ``"mean"``, how a bag of ids is reduced to one vector.
        dtype: storage dtype of the tables, ``"fp32"``, ``"fp16"`` or ``"bf16"``.

    Returns:
        F table configs, in the order of ``feature_names``.

    Example::

        tables = table_configs(spec.sparse_names, spec.cardinalities, embedding_dim=16)
        ebc = EmbeddingBagCollection(tables)
    """
    return [
        EmbeddingBagConfig(
            name=f"t_{feature}",
            embedding_dim=embedding_dim,
            num_embeddings=cardinality,
            feature_names=[feature],
            pooling=POOLING_NAMES[pooling],
            data_type=DATA_TYPE_NAMES[dtype],
        )
        for feature, cardinality in zip(feature_names, cardinalities, strict=True)
    ]


def linear_table_configs(configs: list[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """Dimension-1 twins of ``configs`` (same rows, features and pooling, name ``<t>_linear``):
    a collection of them pools one weight per id, the first-order ("linear", "wide") term of
    DeepFM, Wide&Deep and xDeepFM, through the same kernels as every other table.

    Args:
        configs: the model's tables.

    Returns:
        One dimension-1 table per table of ``configs``, in the same order.

    Example::

        linear = EmbeddingBagCollection(linear_table_configs(tables))
    """
    return [
        EmbeddingBagConfig(
            name=f"{c.name}_linear",
            embedding_dim=1,
            num_embeddings=c.num_embeddings,
            feature_names=list(c.feature_names),
            pooling=c.pooling,
            data_type=c.data_type,
        )
        for c in configs
    ]
