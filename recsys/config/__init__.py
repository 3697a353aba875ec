"""Run configuration: nested dataclasses, TOML recipes and ``--section.key=value`` overrides.

Precedence is dataclass defaults < TOML recipe < command line. Every field carries a docstring
(the string literal under it); :func:`config_reference` renders them as the reference that
``recsys config --reference`` prints and the docs' configuration page shows. Unknown keys and
wrongly typed values raise ``ValueError`` naming the key, where it came from, and the closest
valid key or the expected type.

Example::

    cfg = load_config("configs/dlrm_synthetic.toml", ["--train.batch_size=2048"])
    cfg.train.batch_size  # 2048
"""

from recsys.config.loading import (
    config_differences,
    config_reference,
    field_docs,
    load_config,
    load_saved_config,
    names_its_run,
    to_toml,
)
from recsys.config.models import (
    CrossConfig,
    DynamicConfig,
    MMoEConfig,
    ModelConfig,
    PNNConfig,
    StorageConfig,
    XDeepFMConfig,
)
from recsys.config.sections import (
    CheckpointConfig,
    Config,
    CriteoConfig,
    DataConfig,
    DistributedConfig,
    PreprocessConfig,
    RunConfig,
    SyntheticConfig,
    TrainConfig,
)
from recsys.config.sequences import (
    RANKING_METRICS,
    SEQUENCE_MODELS,
    TARGET_RANKING_MODELS,
    NextItemConfig,
    SequenceModelConfig,
    SyntheticSequencesConfig,
)

__all__ = [
    "RANKING_METRICS",
    "SEQUENCE_MODELS",
    "TARGET_RANKING_MODELS",
    "CheckpointConfig",
    "Config",
    "CriteoConfig",
    "CrossConfig",
    "DataConfig",
    "DistributedConfig",
    "DynamicConfig",
    "MMoEConfig",
    "ModelConfig",
    "NextItemConfig",
    "PNNConfig",
    "PreprocessConfig",
    "RunConfig",
    "SequenceModelConfig",
    "StorageConfig",
    "SyntheticConfig",
    "SyntheticSequencesConfig",
    "TrainConfig",
    "XDeepFMConfig",
    "config_differences",
    "config_reference",
    "field_docs",
    "load_config",
    "load_saved_config",
    "names_its_run",
    "to_toml",
]
