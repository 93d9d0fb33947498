"""`rlax config show`: the whole resolved config, each value with where it came from."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from rlax_core.config.base import EXIT_CONFIG_ERROR, ConfigError
from rlax_core.config.loading import DEFAULT_SOURCE, config_to_dict, leaf_paths, load_config_with_sources
from rlax_core.config.run_config import RunConfig
from rlax_core.config.trainer import merge_objective, objective_presets


def _source_of(path: str, sources: dict[str, str]) -> str:
    # A value inside a mapping set as a whole (`objective: {...}`) came from where the mapping did.
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        found = sources.get(".".join(parts[:end]))
        if found is not None:
            return found
    return DEFAULT_SOURCE


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _lines(node: dict[str, Any], sources: dict[str, str], prefix: str, indent: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        pad = "  " * indent
        if isinstance(value, dict) and value:
            out.append((f"{pad}{key}:", ""))
            out.extend(_lines(value, sources, f"{path}.", indent + 1))
        else:
            out.append((f"{pad}{key}: {_scalar(value)}", _source_of(path, sources)))
    return out


def render_config(config: RunConfig, sources: dict[str, str]) -> str:
    """The config as YAML, every value followed by `# <source>`: the file that set it, a
    `base:` file it came from, `override`, `preset <name>` (an objective field the preset
    sets), or `default` (its section's default)."""
    tree = config_to_dict(config)
    sources = dict(sources)
    # The objective as the trainer builds it: the preset's fields, then the run's overrides.
    preset = objective_presets()[config.trainer.preset]
    tree["trainer"]["objective"] = merge_objective(preset, config.trainer.objective)
    preset_source = f"preset {config.trainer.preset}"
    for leaf in leaf_paths(preset, "trainer.objective."):
        if _source_of(leaf, sources) == DEFAULT_SOURCE:
            sources[leaf] = preset_source
    lines = _lines(tree, sources, "", 0)
    width = max(len(text) for text, _ in lines)
    return "\n".join(f"{text.ljust(width)}  # {source}" if source else text for text, source in lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`rlax config show [CONFIG] [key=value ...]`: print the resolved config (the defaults
    when no file is given) with where each value came from; a rejected config prints the
    reason and exits with `EXIT_CONFIG_ERROR`."""
    parser = argparse.ArgumentParser(prog="rlax config", description=main.__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="the resolved config, each value with its source")
    show.add_argument("config", nargs="?", help="a run config YAML (none: the defaults)")
    show.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    path = args.config
    overrides = list(args.overrides)
    if path is not None and "=" in path:
        # `rlax config show key=value`: overrides of the defaults, no file.
        path, overrides = None, [path, *overrides]
    try:
        config, sources = load_config_with_sources(path, overrides)
    except ConfigError as error:
        print(f"rlax config: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    sys.stdout.write(render_config(config, sources))
    return 0
