"""`rlax`, the one front door on every node.

    rlax launch CONFIG [key=value ...]            every component as a local process (rlax-controller)
    rlax controller --config FILE [key=value ...]                                    (rlax-controller)
    rlax trainer --config FILE [key=value ...]                                       (rlax-trainer)
    rlax worker --config FILE --index I [key=value ...]                              (rlax-inference)
    rlax paramserver --bind ADDRESS [--keep N --state-dir DIR ...]                   (rlax-paramserver)
    rlax verifier --bind ADDRESS [...]                                               (rlax-data)
    rlax eval --config FILE [--weights DIR] [--out DIR]                              (rlax-inference)
    rlax curate ... | rlax convert ...                               (rlax-data, rlax-trainer)

A node installs only the package of the component it runs; `rlax` dispatches to it and,
when it is not installed, names the package to `pip install`. Each component's own entry
point (`rlax-trainer`, `rlax-worker`, ...) is the same program. The two servers take
their own flags, no run config (a parameter-server node installs nothing else). The
other component commands share
`component_main`: one argument set (`--config`, dotted overrides, `--log-level`,
`--check-config`), one logging set-up, and one exit-code contract: a config the component
rejects exits with `EXIT_CONFIG_ERROR` (78), which the supervisor never restarts.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlax_core.config import EXIT_CONFIG_ERROR, ConfigError, RunConfig, load_config

__all__ = [
    "COMMANDS",
    "EXIT_MISSING_COMPONENT",
    "component_main",
    "exit_on_sigterm",
    "main",
    "select_platform",
    "setup_logging",
]

# sysexits.h EX_UNAVAILABLE: the command's component is not installed on this node.
EXIT_MISSING_COMPONENT = 69
EXIT_TIMEOUT = 3


@dataclass(frozen=True)
class Command:
    """`rlax NAME ...` runs `module:function(argv)` from `distribution`."""

    module: str
    function: str
    distribution: str
    help: str


COMMANDS: dict[str, Command] = {
    "launch": Command(
        "rlax_controller.launcher",
        "main",
        "rlax-controller",
        "run every component as a supervised local process",
    ),
    "controller": Command(
        "rlax_controller.controller_process", "controller_main", "rlax-controller", "the controller"
    ),
    "trainer": Command("rlax_trainer.trainer_process", "main", "rlax-trainer", "the trainer process"),
    "worker": Command("rlax_inference.worker_process", "main", "rlax-inference", "one inference worker"),
    "paramserver": Command(
        "rlax_paramserver.paramserver_process", "main", "rlax-paramserver", "the parameter server"
    ),
    "verifier": Command("rlax_data.verifier_process", "main", "rlax-data", "the verifier service"),
    "eval": Command(
        "rlax_inference.eval_process",
        "main",
        "rlax-inference",
        "pass@k of a run's weights on its eval prompts",
    ),
    "curate": Command(
        "rlax_data.curation.cli", "main", "rlax-data", "data curation (pass-rate filter, dedup)"
    ),
    "convert": Command(
        "rlax_trainer.convert", "main", "rlax-trainer", "convert checkpoints (GGUF/RLAX -> HF)"
    ),
    "config": Command(
        "rlax_core.config.show",
        "main",
        "rlax-core",
        "`rlax config show CONFIG [key=value ...]`: the resolved config with each value's source",
    ),
    "keys": Command(
        "rlax_protocol.auth",
        "keys_main",
        "rlax-protocol",
        "a run's credentials, for components started by hand",
    ),
}


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def select_platform(platform: str) -> None:
    """Choose JAX's backend (empty: JAX's default). JAX reads `JAX_PLATFORMS` when it is
    imported; a component whose package imports JAX already (the trainer's and the worker's
    do) gets the same setting through `jax.config`, which holds until a backend starts.
    Whether the backend then is the one asked for is `rlax_model.require_platform`'s check."""
    if not platform:
        return
    os.environ["JAX_PLATFORMS"] = platform
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.config.update("jax_platforms", platform)


def exit_on_sigterm() -> None:
    """SIGTERM from the supervisor becomes SystemExit, so `finally` blocks close sockets."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def component_main(
    prog: str,
    argv: Sequence[str] | None,
    run: Callable[[RunConfig, argparse.Namespace], int],
    *,
    check: Callable[[RunConfig, argparse.Namespace], object] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    description: str = "",
) -> int:
    """Parse `--config FILE [key=value ...]`, set up logging, and run the component.

    `check(config, args)` builds the component's typed configs (raising `ConfigError` or
    `ValueError` on a bad one); `--check-config` runs only that and exits, which is how
    `rlax launch` validates a component without importing it into its own process.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description or None)
    parser.add_argument(
        "--config", required=True, help="run config YAML (the resolved one under rlax launch)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.optimizer.lr=1e-6"
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--check-config", action="store_true", help="validate the config for this component and exit"
    )
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_level)
    try:
        config = load_config(args.config, list(args.overrides))
        if check is not None:
            try:
                check(config, args)
            except ConfigError:
                raise
            except ValueError as error:  # msgspec's ValidationError is one
                raise ConfigError(str(error)) from None
        if args.check_config:
            return 0
        return int(run(config, args) or 0)
    except ConfigError as error:
        print(f"{prog}: invalid config: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except TimeoutError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return EXIT_TIMEOUT


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {c.help} ({c.distribution})" for name, c in COMMANDS.items()]
    return "usage: rlax COMMAND [ARGS ...]\n\ncommands:\n" + "\n".join(lines)


def resolve(name: str) -> Callable[[list[str]], int]:
    """The function behind `rlax NAME`; `SystemExit(EXIT_MISSING_COMPONENT)` with the package
    to install when the component is not installed here."""
    command = COMMANDS[name]
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing != command.module.split(".")[0]:
            raise  # the component is there but one of its own dependencies is not
        print(
            f"rlax {name}: the {command.distribution} package is not installed on this node; "
            f"install it with `pip install {command.distribution}`",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_MISSING_COMPONENT) from None
    function: Callable[[list[str]], int] = getattr(module, command.function)
    return function


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rlax: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return int(resolve(name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
