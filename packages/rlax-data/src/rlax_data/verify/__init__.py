"""Verifiers: one batched interface for math, exact match, Countdown and sandboxed code."""

from rlax_data.verify.answers import (
    ExactMatchConfig,
    ExactMatchVerifier,
    MathConfig,
    MathVerifier,
    extract_answer,
    normalize_answer,
)
from rlax_data.verify.base import Verifier, VerifyItem, VerifyResult
from rlax_data.verify.code import CodeConfig, CodeVerifier, extract_code
from rlax_data.verify.countdown import CountdownConfig, CountdownVerifier, evaluate_countdown
from rlax_data.verify.registry import (
    RoutingConfig,
    RoutingVerifier,
    ShapedConfig,
    build_verifier,
    load_verifier_config,
    register_verifier,
    registered_configs,
)
from rlax_data.verify.sandbox import CaseOutcome, ExecJob, JobResult, Sandbox, SandboxConfig, bwrap_available
from rlax_data.verify.shaping import OverlongConfig, ShapedVerifier, ShapingConfig, overlong_penalty

__all__ = [
    "CaseOutcome",
    "CodeConfig",
    "CodeVerifier",
    "CountdownConfig",
    "CountdownVerifier",
    "ExactMatchConfig",
    "ExactMatchVerifier",
    "ExecJob",
    "JobResult",
    "MathConfig",
    "MathVerifier",
    "OverlongConfig",
    "RoutingConfig",
    "RoutingVerifier",
    "Sandbox",
    "SandboxConfig",
    "ShapedConfig",
    "ShapedVerifier",
    "ShapingConfig",
    "Verifier",
    "VerifyItem",
    "VerifyResult",
    "build_verifier",
    "bwrap_available",
    "evaluate_countdown",
    "extract_answer",
    "extract_code",
    "load_verifier_config",
    "normalize_answer",
    "overlong_penalty",
    "register_verifier",
    "registered_configs",
]
