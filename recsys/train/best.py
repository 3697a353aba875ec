"""The best validation of a run: which checkpoint ``checkpoint.keep_best`` keeps as ``best``,
and when ``train.early_stopping_patience`` stops training.

A validation improves on the best one when its metric is strictly better (higher AUC, lower
logloss; higher HR@k, NDCG@k and MRR of a sequence model's ranking); the first validation is
always the best so far. The tracker's state is part of the
checkpoint, so a resumed run compares with the best of the run it continues.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from recsys.config import RANKING_METRICS, SEQUENCE_MODELS, Config

# metric name -> (key of the valid eval result, True when higher is better)
METRICS = {
    "valid_auc": ("auc", True),
    "valid_logloss": ("logloss", False),
    **{name: (name.removeprefix("valid_"), True) for name in RANKING_METRICS},
}


@dataclass
class BestValidation:
    """The best validation so far and how many validations came after it.

    Example::

        best = BestValidation("valid_auc")
        best.update(200, {"auc": 0.67, "logloss": 0.45})  # True: the first
        best.update(300, {"auc": 0.65, "logloss": 0.46})  # False; best.since == 1
    """

    metric: str
    value: float = math.nan
    step: int = -1
    since: int = 0
    """Validations after the best one."""

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric = {self.metric!r}; expected one of {', '.join(METRICS)}")

    def update(self, step: int, result: dict[str, Any]) -> bool:
        """Take the validation of ``step``; True when it is the new best."""
        key, higher = METRICS[self.metric]
        value = float(result[key])
        better = value > self.value if higher else value < self.value
        if not math.isnan(value) and (self.step < 0 or better):
            self.value, self.step, self.since = value, step, 0
            return True
        self.since += 1
        return False

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["metric"] != self.metric:
            raise ValueError(
                f"the checkpoint tracked the best {state['metric']}, this run {self.metric}; "
                "resume with the same checkpoint.keep_best / train.early_stopping_metric"
            )
        self.value, self.step, self.since = (
            float(state["value"]),
            int(state["step"]),
            int(state["since"]),
        )


def best_validation(config: Config) -> BestValidation | None:
    """The tracker keep_best and early stopping share (None when neither is on).

    Raises:
        ValueError: no validation to watch, or the two watch different metrics.
    """
    keep_best, train = config.checkpoint.keep_best, config.train
    if not keep_best and not train.early_stopping_patience:
        return None
    option = "checkpoint.keep_best" if keep_best else "train.early_stopping_patience"
    if not train.eval_every_steps:
        raise ValueError(f"{option} needs validations: set train.eval_every_steps > 0")
    metric = keep_best or train.early_stopping_metric
    if keep_best and train.early_stopping_patience and metric != train.early_stopping_metric:
        raise ValueError(
            f"checkpoint.keep_best = {keep_best!r} but train.early_stopping_metric = "
            f"{train.early_stopping_metric!r}: watch one metric for both"
        )
    key = "checkpoint.keep_best" if keep_best else "train.early_stopping_metric"
    sequence = config.model.name in SEQUENCE_MODELS
    if sequence != (metric in RANKING_METRICS):
        kind, names = (
            ("a ranking", RANKING_METRICS)
            if sequence
            else ("a CTR", ("valid_auc", "valid_logloss"))
        )
        raise ValueError(
            f"{key} = {metric!r}, but model.name = {config.model.name!r} is evaluated by "
            f"{kind} metric: pick one of {', '.join(names)}"
        )
    return BestValidation(metric)
