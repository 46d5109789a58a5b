"""The whole configuration: every group's schema under its group's name, and the group files in `configs/`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jaxstream.config.errors import require
from jaxstream.config.model import ModelConfig, MoeConfig, ParallelismConfig
from jaxstream.config.scheduler import SchedulerConfig
from jaxstream.config.server import RedisConfig, ServerConfig, SupervisorConfig
from jaxstream.config.worker import WorkerConfig

# The Hydra groups: in a checkout (or an editable install) `jaxstream/configs` links to the top-level
# `configs/`; a built wheel holds them there as files (pyproject.toml's package-data).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class AppConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    def __post_init__(self) -> None:
        # ep's grouped matmuls take their shapes from the step's routing: no fixed order to give them.
        require(not self.worker.batch_invariant or self.moe.strategy == "fused", "moe.strategy",
                f"must be 'fused' under worker.batch_invariant=true, got {self.moe.strategy!r}")


GROUPS = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "moe": MoeConfig,
    "scheduler": SchedulerConfig,
    "redis": RedisConfig,
    "server": ServerConfig,
    "worker": WorkerConfig,
    "supervisor": SupervisorConfig,
}


def register_schemas() -> None:
    """Put every schema in Hydra's ConfigStore: `base_config` for the whole tree and `schema` in
    each group, which the group's YAML files extend."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="base_config", node=AppConfig)
    for group, schema in GROUPS.items():
        store.store(group=group, name="schema", node=schema)


def group_options(group: str) -> list[str]:
    """The YAML files of a config group, by name."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def default_options() -> dict[str, str]:
    """Group -> the option `configs/config.yaml` chooses when no override does."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml"))["defaults"]
    return {group: option for entry in defaults if isinstance(entry, dict) for group, option in entry.items()}

