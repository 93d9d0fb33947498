"""rlax_controller: the RLAX control plane and the `rlax` command line.

The run config (`RunConfig`, `load_config`), the controller (`Controller`,
`RolloutScheduler`), run snapshots, the local launcher and supervisor, metrics and the
run summary. Importing this package imports no JAX; the trainer and worker processes
(`rlax_trainer.trainer_process`, `rlax_inference.worker_process`) live in their own packages.
"""

from rlax_controller.controller import Controller, RolloutScorer
from rlax_controller.launcher import launch
from rlax_controller.metrics import MetricsWriter, ProgressDisplay, plot_run, read_metrics, summary_table
from rlax_controller.process_plan import build_specs, resolve_addresses
from rlax_controller.rollout_scheduler import (
    Batch,
    BatchNotReady,
    PromptItem,
    PromptSource,
    RolloutScheduler,
    RolloutSchedulerConfig,
    ScoredSample,
)
from rlax_controller.snapshot import RunSnapshot, SnapshotError, SnapshotStore
from rlax_controller.supervisor import ProcessSpec, Supervisor, SupervisorReport, UnplannedRestart
from rlax_core.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_config,
)
from rlax_protocol.control_messages import (
    BatchRequest,
    NoBatchYet,
    RunComplete,
    RunStatus,
    StatusQuery,
    TrainBatch,
)

__all__ = [
    "Batch",
    "BatchNotReady",
    "BatchRequest",
    "ConfigError",
    "Controller",
    "MetricsWriter",
    "NoBatchYet",
    "ProcessSpec",
    "ProgressDisplay",
    "PromptItem",
    "PromptSource",
    "RolloutScheduler",
    "RolloutScorer",
    "RunComplete",
    "RunConfig",
    "RunSnapshot",
    "RunStatus",
    "RolloutSchedulerConfig",
    "ScoredSample",
    "SnapshotError",
    "SnapshotStore",
    "StatusQuery",
    "Supervisor",
    "SupervisorReport",
    "TrainBatch",
    "UnplannedRestart",
    "apply_overrides",
    "build_specs",
    "dump_config",
    "launch",
    "load_config",
    "parse_config",
    "plot_run",
    "read_metrics",
    "resolve_addresses",
    "summary_table",
]
