"""Serving a trained model: export a checkpoint to a self-contained ``torch.export`` program,
score parquet or raw logs with it (``recsys predict``), and bring its dynamic tables forward
with the deltas written after it (:mod:`~recsys.serve.exported_deltas`)."""

from recsys.serve.export import export_model, load_exported, predict

__all__ = ["export_model", "load_exported", "predict"]
