"""Model-parallel embeddings under torchrun: plans, the sharded collections, parallelize()."""

from recsys.distributed.parallel import parallelize
from recsys.distributed.planner import ShardingPlan, ShardingType, plan_sharding
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.distributed.sharded_sequence import ShardedEmbeddingCollection

__all__ = [
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingPlan",
    "ShardingType",
    "parallelize",
    "plan_sharding",
]
