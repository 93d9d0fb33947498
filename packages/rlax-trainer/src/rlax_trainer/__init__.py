"""rlax_trainer: the RL objective and its presets, the rollout buffer, a sharded optax learner,
orbax checkpoints and weight publishing."""

from rlax_trainer.buffer import BufferStats, RolloutBatch, RolloutBuffer, collate, validate_group
from rlax_trainer.config import (
    LearnerConfig,
    OptimizerConfig,
    learner_config_from_dict,
    learner_config_to_dict,
    load_learner_config,
    make_optimizer,
)
from rlax_trainer.learner import Learner, TrainState, batch_arrays
from rlax_trainer.objective import (
    PRESET_NAMES,
    AdvantageEstimator,
    ObjectiveConfig,
    load_objective,
    objective_from_dict,
    objective_loss,
    prepare_batch,
    preset,
    register_advantage,
)
from rlax_trainer.sharding import MeshConfig, batch_sharding, make_mesh, param_sharding

__all__ = [
    "PRESET_NAMES",
    "AdvantageEstimator",
    "BufferStats",
    "Learner",
    "LearnerConfig",
    "MeshConfig",
    "ObjectiveConfig",
    "OptimizerConfig",
    "RolloutBatch",
    "RolloutBuffer",
    "TrainState",
    "batch_arrays",
    "batch_sharding",
    "collate",
    "learner_config_from_dict",
    "learner_config_to_dict",
    "load_learner_config",
    "load_objective",
    "make_mesh",
    "make_optimizer",
    "objective_from_dict",
    "objective_loss",
    "param_sharding",
    "prepare_batch",
    "preset",
    "register_advantage",
    "validate_group",
]
