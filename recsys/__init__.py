"""recsys: a PyTorch-native framework for training large recommendation models.

TorchRec's types (KeyedJaggedTensor, EmbeddingBagConfig, KeyedTensor) in and out; recsys
modules and kernels underneath. Moving a TorchRec model over is one import::

    from recsys import EmbeddingBagCollection   # instead of torchrec's
    from recsys import EmbeddingCollection      # unpooled (sequence features)
"""

import logging

# torchrec 1.8 calls torch.fx's is_fx_tracing at import, which on torch 2.13 logs a deprecation
# warning that users cannot act on; keep that one logger quiet.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

from torchrec import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)

from recsys.config import Config, load_config
from recsys.data.batch import Batch, DatasetSpec
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.unpooled import EmbeddingCollection
from recsys.models import DCN, DLRM, DLRM_DCN, PNN, DeepFM, MMoE, WideDeep, XDeepFM

__version__ = "0.1.0"

__all__ = [
    "DCN",
    "DLRM",
    "DLRM_DCN",
    "PNN",
    "Batch",
    "Config",
    "DatasetSpec",
    "DeepFM",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "MMoE",
    "PoolingType",
    "WideDeep",
    "XDeepFM",
    "load_config",
]
