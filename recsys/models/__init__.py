"""Model zoo: architectures only, each built from an EmbeddingBagCollection plus layer sizes,
with ``forward(dense_features, sparse_features) -> logits [B, T]``.

Nothing here reads a config or a dataset: the registry that builds a model from the
``[model]`` section and a dataset's spec is :mod:`recsys.build.models`.
"""

from __future__ import annotations

from recsys.models.dcn import DCN
from recsys.models.deepfm import DeepFM
from recsys.models.dlrm import DLRM, DLRM_DCN
from recsys.models.hstu import HSTU
from recsys.models.hstu_ranking import HSTURanking
from recsys.models.mmoe import MMoE
from recsys.models.pnn import PNN
from recsys.models.sasrec import SASRec
from recsys.models.tables import linear_table_configs, table_configs
from recsys.models.wide_deep import WideDeep
from recsys.models.xdeepfm import XDeepFM

__all__ = [
    "DCN",
    "DLRM",
    "DLRM_DCN",
    "HSTU",
    "PNN",
    "DeepFM",
    "HSTURanking",
    "MMoE",
    "SASRec",
    "WideDeep",
    "XDeepFM",
    "linear_table_configs",
    "table_configs",
]
