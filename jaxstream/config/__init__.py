"""Configuration schemas: the only place defaults live (YAML in `configs/` holds choices and numbers).

Every group has a dataclass schema, registered in Hydra's ConfigStore: `model`, `parallelism` and
`moe` (model.py), `scheduler` (scheduler.py), `redis`, `server` and `supervisor` (server.py),
`worker` (worker.py), all under AppConfig (app.py). `load_config` (loading.py) checks each
command-line override's key or group option (an unknown one fails with the closest names), composes
`configs/config.yaml` with them, type-checks the result against these schemas (a value of the wrong
type fails there, naming the key) and then runs each schema's `__post_init__` checks (a bad value
fails naming the key). Services receive only their slice.

Each field's meaning is the docstring under it: its first line is what `--help` prints beside the
key (`reference()`, help_text.py), the rest says why.

What only the model's files can refute (a model.path that does not exist, a tensor degree that does
not divide the heads) is checked by jaxstream/preflight.py, before any service starts.
"""

from jaxstream.config.app import CONFIG_DIR, GROUPS, AppConfig, default_options, group_options, register_schemas
from jaxstream.config.errors import ConfigError
from jaxstream.config.help_text import field_docs, reference, schema_default
from jaxstream.config.loading import load_config
from jaxstream.config.model import (
    MESH_AXES,
    MOE_STRATEGIES,
    PATH_REQUIRED,
    REASONING_PARSERS,
    TOOL_PARSERS,
    ModelConfig,
    MoeConfig,
    ParallelismConfig,
)
from jaxstream.config.scheduler import SCHEDULING_POLICIES, SPECULATIVE_METHODS, SchedulerConfig
from jaxstream.config.server import (
    LOGPROBS_MODES,
    RESTART_POLICIES,
    SECRET_SOURCES,
    RedisConfig,
    ServerConfig,
    SupervisorConfig,
)
from jaxstream.config.worker import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, WEIGHTS, WORKER_KINDS, WorkerConfig

__all__ = [
    "CONFIG_DIR", "DTYPES", "GROUPS", "KV_CACHE_DTYPES", "LOGPROBS_MODES", "MESH_AXES", "MOE_STRATEGIES",
    "PATH_REQUIRED", "QUANTIZATIONS", "REASONING_PARSERS", "RESTART_POLICIES", "SCHEDULING_POLICIES", "SECRET_SOURCES",
    "SPECULATIVE_METHODS", "TOOL_PARSERS", "WEIGHTS", "WORKER_KINDS", "AppConfig", "ConfigError", "ModelConfig", "MoeConfig",
    "ParallelismConfig", "RedisConfig", "SchedulerConfig", "ServerConfig", "SupervisorConfig", "WorkerConfig",
    "default_options", "field_docs", "group_options", "load_config", "reference", "register_schemas",
    "schema_default",
]
