"""The `rlax` command line.

    rlax launch CONFIG [key=value ...]        every component as a local process, supervised
    rlax controller|trainer|paramserver|verifier --config FILE [key=value ...]
    rlax worker --config FILE --index I [key=value ...]
    rlax eval | curate | convert ...          the packages' tools

Component commands are what `rlax launch` runs; on a cluster each node runs its own with
addresses from the config. A bad config is rejected before anything starts, naming the
field and the value, with exit code 78 (`EXIT_CONFIG_ERROR`, sysexits' EX_CONFIG): `rlax
launch` checks every component's config before it starts a process, and a component
whose config is rejected exits with that code, which the supervisor never restarts.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rlax_controller.config import EXIT_CONFIG_ERROR, ConfigError, RunConfig, load_config

__all__ = ["main"]


def _component_parser(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument(
        "--config", required=True, help="run config YAML (the resolved one under rlax launch)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-6"
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlax", description="RLAX: distributed RL for LLMs with verifiable rewards."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="run every component locally under a supervisor")
    launch.add_argument("config", help="run config YAML")
    launch.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. chaos.interval=5"
    )
    launch.add_argument(
        "--overwrite", action="store_true", help="delete the run's output folder first (else resume)"
    )
    _component_parser(sub, "controller", "the controller: prompts, staleness, batches, snapshots")
    _component_parser(sub, "trainer", "the trainer: SFT warm start, RL updates, checkpoints, publishing")
    worker = _component_parser(sub, "worker", "one inference worker")
    worker.add_argument(
        "--index", type=int, required=True, help="which of workers.addresses this worker serves"
    )
    _component_parser(sub, "paramserver", "the parameter server")
    _component_parser(sub, "verifier", "the verifier service")
    evaluate = _component_parser(
        sub, "eval", "evaluate a checkpoint (pass@k) on the task's evaluation prompts"
    )
    evaluate.add_argument(
        "--checkpoint", default="", help="trainer checkpoint folder (default: the run's newest)"
    )
    evaluate.add_argument("--out", default="", help="folder for the JSON and markdown report")
    # Listed for `rlax -h`; main() hands their arguments to the tools before parsing.
    curate = sub.add_parser("curate", help="data curation (pass-rate pre-filtering, dedup, contamination)")
    curate.add_argument("args", nargs=argparse.REMAINDER)
    convert = sub.add_parser("convert", help="convert checkpoints between HF and RLAX formats")
    convert.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _load(args: argparse.Namespace) -> RunConfig:
    return load_config(args.config, list(args.overrides))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("curate", "convert"):
        # These tools own their whole command line (their -h included).
        from rlax_controller import components

        return components.run_tool(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "launch":
            from rlax_controller.launcher import launch

            report = launch(args.config, list(args.overrides), overwrite=args.overwrite)
            if report.config_error:
                return EXIT_CONFIG_ERROR
            return 0 if report.success else 1
        config = _load(args)
        from rlax_controller import components

        if args.command == "controller":
            return components.run_controller(config)
        if args.command == "trainer":
            return components.run_trainer(config)
        if args.command == "worker":
            return components.run_worker(config, args.index)
        if args.command == "paramserver":
            return components.run_paramserver(config)
        if args.command == "verifier":
            return components.run_verifier(config)
        if args.command == "eval":
            return components.run_eval(config, checkpoint=args.checkpoint, out=args.out)
    except ConfigError as error:
        print(f"rlax {args.command}: invalid config: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except TimeoutError as error:
        print(f"rlax {args.command}: {error}", file=sys.stderr)
        return 3
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
