"""Typed run configuration: one frozen struct per component, composed into `RunConfig`.

A run is described by a YAML file (which may build on others with `base:`) plus dotted
command-line overrides (`trainer.optimizer.lr=1e-6`, `chaos.interval=5`). Everything is
validated on load, before any process starts; an error names the field path and the
offending value (`workers.count = 0: must be >= 1`). Unknown keys are errors too.

One module per section (`run`, `model`, `data`, `agent`, `workers`, `trainer`,
`paramserver`, `verifier`, `controller`, `evaluation` for `eval:`, `chaos`, `supervisor`,
`addresses`, `launcher`, `security`), each JAX-free; the components use these structs
themselves (`rlax_trainer.LearnerConfig` extends `UpdateOptions` and takes an
`OptimizerConfig`, `rlax_inference.EngineConfig` takes its defaults from `WorkersSection`,
`rlax_model.ModelConfig.tiny` takes the `ModelSection` shape by name), so an option is
defined once, with one default. `rlax config show` prints the resolved tree with where
each value came from.
"""

from rlax_core.config.addresses import AddressesSection
from rlax_core.config.agent import AgentSection
from rlax_core.config.base import AUTO, EXIT_CONFIG_ERROR, ROLES, ConfigError, Section, rejected_by
from rlax_core.config.chaos import ChaosSection
from rlax_core.config.controller import ControllerSection
from rlax_core.config.data import DataSection
from rlax_core.config.evaluation import EvalSection
from rlax_core.config.launcher import HealthCheckSection, LauncherSection, RoleResources
from rlax_core.config.loading import (
    apply_overrides,
    config_to_dict,
    dump_config,
    load_config,
    load_config_with_sources,
    parse_config,
    read_config_file,
)
from rlax_core.config.model import ModelSection
from rlax_core.config.paramserver import ParamServerSection
from rlax_core.config.paramserver_folders import (
    MEMORY_MIN_FREE_BYTES,
    MEMORY_ROOT,
    paramserver_dirs,
    published_state_dir,
)
from rlax_core.config.run import RunSection
from rlax_core.config.run_config import RunConfig
from rlax_core.config.security import SecuritySection
from rlax_core.config.show import render_config
from rlax_core.config.supervisor import SupervisorSection
from rlax_core.config.trainer import (
    LORA_TARGET_GROUPS,
    MESH_AXES,
    PRESETS,
    LoraConfig,
    OptimizerConfig,
    TrainerSection,
    UpdateOptions,
)
from rlax_core.config.verifier import VerifierSection
from rlax_core.config.workers import WorkersSection

__all__ = [
    "AUTO",
    "EXIT_CONFIG_ERROR",
    "MEMORY_MIN_FREE_BYTES",
    "MEMORY_ROOT",
    "MESH_AXES",
    "PRESETS",
    "ROLES",
    "AddressesSection",
    "AgentSection",
    "ChaosSection",
    "ConfigError",
    "ControllerSection",
    "DataSection",
    "EvalSection",
    "HealthCheckSection",
    "LauncherSection",
    "ModelSection",
    "LORA_TARGET_GROUPS",
    "LoraConfig",
    "OptimizerConfig",
    "ParamServerSection",
    "RoleResources",
    "RunConfig",
    "RunSection",
    "Section",
    "SecuritySection",
    "SupervisorSection",
    "TrainerSection",
    "UpdateOptions",
    "VerifierSection",
    "WorkersSection",
    "apply_overrides",
    "config_to_dict",
    "dump_config",
    "load_config",
    "load_config_with_sources",
    "paramserver_dirs",
    "parse_config",
    "published_state_dir",
    "read_config_file",
    "render_config",
    "rejected_by",
]
