"""`rlax controller`: the controller process. It imports no JAX: the task, tokenizer and
verifiers come from `rlax_data` and `rlax_core`, the weights never pass through it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rlax_controller import preflight
from rlax_core.cli import component_main, exit_on_sigterm
from rlax_core.config import RunConfig

__all__ = ["controller_main", "run_controller"]


def _scorer(config: RunConfig, task: Any) -> Any:
    if config.verifier.mode == "service":
        from rlax_core.addresses import resolver
        from rlax_data.verifier_process import RemoteVerifier
        from rlax_protocol.transport import RpcClient

        address, timeout_s = config.verifier.address, config.verifier.timeout_s
        # The service's address now (the launcher's address book): it may move to another node.
        client = RpcClient(
            address,
            timeout_s=timeout_s,
            role="verifier-client",
            resolve=resolver(config.addresses.book, "verifier", address),
        )
        task.verifier = RemoteVerifier(address, timeout_s=timeout_s, client=client)
    return task


def run_controller(config: RunConfig) -> int:
    from rlax_controller.controller import Controller

    exit_on_sigterm()
    task = preflight.run_task(config)
    controller = Controller(
        config,
        source=task.prompt_source(),
        scorer=_scorer(config, task),
        eval_items=task.eval_items(),
        stop_token_ids=task.stop_token_ids,
        worker_addresses=config.workers.addresses,
    )
    try:
        return controller.run()
    finally:
        controller.close()


def controller_main(argv: Sequence[str] | None = None) -> int:
    def check(config: RunConfig, args: argparse.Namespace) -> None:
        preflight.check_prompts_fit(config, preflight.run_task(config))

    return component_main("rlax controller", argv, lambda config, args: run_controller(config), check=check)
