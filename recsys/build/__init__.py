"""Config -> objects: the model registry and :func:`~recsys.build.models.build_model` (``[model]``
and a dataset's spec -> a model, its tables on the ``meta`` device under torchrun), each
table's dynamic options (:mod:`~recsys.build.dynamic_tables`) and storage tier
(:mod:`~recsys.build.tiered_tables`), the fused embedding optimizer of ``[train]``, and the
sharded model of ``[distributed]`` (:mod:`~recsys.build.sharding`)."""

from recsys.build.models import MODELS, build_model

__all__ = ["MODELS", "build_model"]
