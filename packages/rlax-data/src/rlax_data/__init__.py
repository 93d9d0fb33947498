"""rlax_data: datasets, built-in tasks, verifiers, curation, prompt stream and evaluation."""

from rlax_data.datasets import (
    CallCase,
    CodeTests,
    Dataset,
    DatasetError,
    IOCase,
    Message,
    Record,
    load_dataset,
    load_jsonl,
    load_parquet,
    write_jsonl,
    write_parquet,
)
from rlax_data.envs import (
    Environment,
    EnvStep,
    Tool,
    ToolCall,
    ToolEnvironment,
    ToolFormat,
    ToolResult,
    make_environment,
    register_environment,
)
from rlax_data.filtering import DynamicFilter
from rlax_data.pass_at_k import EvalReport, avg_at_k, evaluate, maj_at_k, pass_at_k
from rlax_data.sampling import Sampler, render_prompts
from rlax_data.stream import PromptStream, StreamSource
from rlax_data.tasks import (
    ArithmeticTask,
    CountdownTask,
    SortingTask,
    Task,
    TaskFormat,
    ToolArithmeticTask,
    make_task,
)
from rlax_data.verify import Verifier, VerifyResult, build_verifier, load_verifier_config

__version__ = "0.1.0"

__all__ = [
    "ArithmeticTask",
    "CallCase",
    "CodeTests",
    "CountdownTask",
    "Dataset",
    "DatasetError",
    "DynamicFilter",
    "EnvStep",
    "Environment",
    "EvalReport",
    "IOCase",
    "Message",
    "PromptStream",
    "Record",
    "Sampler",
    "SortingTask",
    "StreamSource",
    "Task",
    "TaskFormat",
    "Tool",
    "ToolArithmeticTask",
    "ToolCall",
    "ToolEnvironment",
    "ToolFormat",
    "ToolResult",
    "Verifier",
    "VerifyResult",
    "avg_at_k",
    "build_verifier",
    "evaluate",
    "load_dataset",
    "load_jsonl",
    "load_parquet",
    "load_verifier_config",
    "maj_at_k",
    "make_environment",
    "make_task",
    "pass_at_k",
    "register_environment",
    "render_prompts",
    "write_jsonl",
    "write_parquet",
]
