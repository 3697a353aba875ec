"""Model-parallel embeddings under torchrun: plans, the sharded collection, parallelize()."""

from recsys.distributed.parallel import parallelize
from recsys.distributed.planner import ShardingPlan, ShardingType, plan_sharding
from recsys.distributed.sharded import ShardedEmbeddingBagCollection

__all__ = [
    "ShardedEmbeddingBagCollection",
    "ShardingPlan",
    "ShardingType",
    "parallelize",
    "plan_sharding",
]
