"""One typed config tree for a run.

Every component owns one section; a run is one `Config`. Loaded from YAML with `section.key=value`
overrides; unknown keys fail naming the key, the file and the closest valid name. Units are in the
names: `prompts_per_step`, `samples_per_prompt`, `max_staleness` (policy versions), `*_s` (seconds).

One module per section (or a few related ones), `run` for the root and `loading` for reading files; import
every name from here. The package imports only pydantic and yaml so that `asyncrl --help` and
`asyncrl check` stay fast.
"""

from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.base import ConfigError, Mode, Section
from asyncrl.config.buffer import BufferConfig
from asyncrl.config.learner import LearnerConfig, LoraConfig, WeightSyncConfig
from asyncrl.config.loading import (
    DEFAULT_CONFIG,
    RECIPES,
    load_config,
    parse_override,
    resolve_recipe_path,
    shipped_recipes,
    validate_config,
)
from asyncrl.config.model import DataConfig, ModelConfig
from asyncrl.config.observe import AlarmName, AlarmRule, EvalConfig, TelemetryConfig, WandbConfig
from asyncrl.config.rollout import EnvConfig, RolloutConfig, ToolsConfig
from asyncrl.config.run import CheckpointConfig, ClusterConfig, Config, FaultsConfig, StorageConfig

__all__ = [
    "DEFAULT_CONFIG",
    "RECIPES",
    "AlarmName",
    "AlarmRule",
    "AlgorithmConfig",
    "BufferConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "FaultsConfig",
    "LearnerConfig",
    "LoraConfig",
    "Mode",
    "ModelConfig",
    "RolloutConfig",
    "Section",
    "StorageConfig",
    "TelemetryConfig",
    "ToolsConfig",
    "WandbConfig",
    "WeightSyncConfig",
    "load_config",
    "parse_override",
    "resolve_recipe_path",
    "shipped_recipes",
    "validate_config",
]
