"""The RL objective as composable parts; presets are configs (`rlax_core/config/objective_presets.yaml`)."""

from rlax_trainer.objective.advantages import (
    ADVANTAGE_REGISTRY,
    GAE,
    AdvantageEstimator,
    BatchNormalized,
    GroupCentered,
    GroupNormalized,
    LeaveOneOut,
    TokenRewardEstimator,
    TurnAdvantageEstimator,
    advantage_from_dict,
    register_advantage,
)
from rlax_trainer.objective.aggregation import Aggregation, aggregation_weights
from rlax_trainer.objective.config import (
    PRESET_NAMES,
    ObjectiveConfig,
    OverlongConfig,
    ValueConfig,
    load_objective,
    objective_from_dict,
    objective_to_dict,
    preset,
    shape_rewards,
)
from rlax_trainer.objective.importance import (
    CorrectionConfig,
    ImportanceConfig,
    ImportanceWeights,
    behaviour_weights,
    importance_weights,
)
from rlax_trainer.objective.loss import PreparedBatch, objective_loss, prepare_batch
from rlax_trainer.objective.regularizers import KLConfig, kl_estimate, token_entropy
from rlax_trainer.objective.turn_credit import CreditAssignment, CreditConfig, per_turn_advantages

__all__ = [
    "ADVANTAGE_REGISTRY",
    "GAE",
    "PRESET_NAMES",
    "AdvantageEstimator",
    "Aggregation",
    "BatchNormalized",
    "CorrectionConfig",
    "CreditAssignment",
    "CreditConfig",
    "GroupCentered",
    "GroupNormalized",
    "ImportanceConfig",
    "ImportanceWeights",
    "KLConfig",
    "LeaveOneOut",
    "ObjectiveConfig",
    "OverlongConfig",
    "PreparedBatch",
    "TokenRewardEstimator",
    "TurnAdvantageEstimator",
    "ValueConfig",
    "advantage_from_dict",
    "behaviour_weights",
    "aggregation_weights",
    "importance_weights",
    "kl_estimate",
    "load_objective",
    "objective_from_dict",
    "objective_to_dict",
    "objective_loss",
    "per_turn_advantages",
    "preset",
    "prepare_batch",
    "register_advantage",
    "shape_rewards",
    "token_entropy",
]
