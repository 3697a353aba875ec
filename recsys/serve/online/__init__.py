"""``recsys serve``: online scoring of an exported model on MLServer (the Open Inference
Protocol and a plain JSON route), its dynamic tables following a training run's deltas
(see docs/serving.md)."""
