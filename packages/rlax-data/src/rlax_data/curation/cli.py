"""`rlax curate ...`: the curation passes as a command-line tool.

    generate TASK OUT [--difficulty easy] [-n 1000] [--seed 0]   write a built-in task's records
    dedup IN OUT [--threshold 0.8] [--exact-only]                exact + near duplicates
    contamination IN OUT --eval EVAL [--n 13] [--min-overlap 0.5]
    length IN OUT --max-prompt-tokens N [--max-answer-tokens M] [--tokenizer chars|words]
    prefilter IN OUT --sampler MODULE_OR_FILE.py:FACTORY [--sampler-arg k=v ...]
              [--n 8] [--lower 0] [--upper 1] [--verifier-config routes.yaml]
    buckets IN OUTDIR [--edges 0.25,0.5,0.75]                    one JSONL per difficulty bucket

Each pass writes its output atomically, a JSON report beside it (`OUT.report.json`,
or `--report PATH`) and prints a summary table. `prefilter` needs a sampler: FACTORY
is called with the `--sampler-arg` pairs (as strings) and must return a callable
`(prompts, n) -> [[completion] * n]` — the inference engine's sampler in a real run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml
from rich.console import Console

from rlax_data._io import atomic_write_json
from rlax_data.curation.contamination import ContaminationConfig, find_contamination
from rlax_data.curation.curriculum import difficulty_buckets
from rlax_data.curation.dedup import DedupConfig, deduplicate
from rlax_data.curation.length import filter_by_length
from rlax_data.curation.prefilter import PassRateConfig, prefilter_by_pass_rate
from rlax_data.curation.report import render_summary
from rlax_data.datasets import Record, load_dataset, write_jsonl
from rlax_data.sampling import Sampler
from rlax_data.verify.base import Verifier
from rlax_data.verify.registry import build_verifier, load_verifier_config

__all__ = ["load_sampler", "main"]


def _report_path(args: argparse.Namespace) -> Path:
    return Path(args.report) if args.report else Path(str(args.out) + ".report.json")


def _finish(args: argparse.Namespace, name: str, kept: Sequence[Record], report: msgspec.Struct) -> int:
    write_jsonl(kept, args.out)
    atomic_write_json(_report_path(args), report)
    render_summary({name: report}, console=Console(stderr=True))
    return 0


def _tokenizer(name: str) -> Callable[[str], Sequence[int]]:
    if name == "chars":
        return lambda text: [ord(c) for c in text]
    if name == "words":
        return lambda text: [0] * len(text.split())
    raise ValueError(f"--tokenizer: {name!r} is not one of 'chars', 'words'")


def load_sampler(spec: str, kwargs: dict[str, str]) -> Sampler:
    """`module.path:factory` or `path/to/file.py:factory`; returns `factory(**kwargs)`."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"--sampler {spec!r}: expected MODULE:FACTORY or FILE.py:FACTORY")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"--sampler {spec!r}: no file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"_rlax_sampler_{path.stem}", path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--sampler {spec!r}: {attr!r} is not a callable in {target}")
    sampler = factory(**kwargs)
    if not callable(sampler):
        raise ValueError(f"--sampler {spec!r}: the factory returned {type(sampler).__name__}, not a sampler")
    return sampler  # type: ignore[no-any-return]


def _pairs(items: Sequence[str], option: str = "--sampler-arg") -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", key):
            raise ValueError(f"{option} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _verifier(path: str | None) -> Verifier:
    if path is None:
        from rlax_data.verifier_process import default_routes

        return build_verifier(default_routes())
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"--verifier-config {path}: expected a mapping")
    return build_verifier(load_verifier_config(data))


def _cmd_generate(args: argparse.Namespace) -> int:
    from rlax_data.tasks import make_task

    # Values read as YAML scalars, as `data.task_args` in a run config: 3 is a number.
    fields = {k: yaml.safe_load(v) for k, v in _pairs(args.task_arg or [], "--task-arg").items()}
    task = make_task(args.task, args.difficulty, fields, source="--task-arg")
    recs = task.generate(args.n, seed=args.seed)
    write_jsonl(recs, args.out)
    Console(stderr=True).print(f"wrote {len(recs)} {args.task}/{args.difficulty} records to {args.out}")
    return 0


def _cmd_dedup(args: argparse.Namespace) -> int:
    cfg = DedupConfig(threshold=args.threshold, num_perm=args.num_perm, near=not args.exact_only)
    kept, report = deduplicate(load_dataset(args.inp).records, cfg)
    return _finish(args, "dedup", kept, report)


def _cmd_contamination(args: argparse.Namespace) -> int:
    cfg = ContaminationConfig(n=args.n, min_overlap=args.min_overlap)
    kept, report = find_contamination(load_dataset(args.inp).records, load_dataset(args.eval).records, cfg)
    return _finish(args, "contamination", kept, report)


def _cmd_length(args: argparse.Namespace) -> int:
    kept, report = filter_by_length(
        load_dataset(args.inp).records,
        _tokenizer(args.tokenizer),
        max_prompt_tokens=args.max_prompt_tokens,
        max_answer_tokens=args.max_answer_tokens,
    )
    return _finish(args, "length", kept, report)


def _cmd_prefilter(args: argparse.Namespace) -> int:
    sampler = load_sampler(args.sampler, _pairs(args.sampler_arg))
    cfg = PassRateConfig(n=args.n, lower=args.lower, upper=args.upper, batch_size=args.batch_size)
    kept, report = prefilter_by_pass_rate(
        load_dataset(args.inp).records,
        sampler,
        _verifier(args.verifier_config),
        cfg,
        # A sampler may say how it takes a record (a multi-turn one takes the record itself).
        render=getattr(sampler, "render", None),
        out_path=args.out,
        report_path=_report_path(args),
    )
    render_summary({"prefilter": report}, console=Console(stderr=True))
    return 0


def _cmd_buckets(args: argparse.Namespace) -> int:
    edges = [float(x) for x in args.edges.split(",") if x.strip()]
    buckets = difficulty_buckets(load_dataset(args.inp).records, edges=edges)
    out = Path(args.outdir)
    counts: dict[str, Any] = {}
    for i, (name, recs) in enumerate(buckets.items()):
        path = out / f"bucket{i}.jsonl"
        write_jsonl(recs, path)
        counts[path.name] = {"pass_rate": name, "records": len(recs)}
    atomic_write_json(out / "buckets.json", counts)
    Console(stderr=True).print(counts)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlax curate", description="RLAX data curation passes.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write a built-in task's records")
    g.add_argument("task")
    g.add_argument("out")
    g.add_argument("--difficulty", default="easy")
    g.add_argument("-n", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--task-arg", action="append", default=[], help="KEY=VALUE: a task field, as `data.task_args`"
    )
    g.set_defaults(fn=_cmd_generate)

    def io(name: str, help_: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_)
        s.add_argument("inp", metavar="IN")
        s.add_argument("out", metavar="OUT")
        s.add_argument("--report", help="report path (default OUT.report.json)")
        return s

    d = io("dedup", "remove exact and near duplicates")
    d.add_argument(
        "--threshold",
        type=float,
        default=0.8,
        help="Jaccard of the wording at which records with identical answer keys are near-duplicates",
    )
    d.add_argument("--num-perm", type=int, default=128)
    d.add_argument("--exact-only", action="store_true")
    d.set_defaults(fn=_cmd_dedup)

    c = io("contamination", "remove records overlapping an evaluation set")
    c.add_argument("--eval", required=True)
    c.add_argument(
        "--n", type=int, default=13, help="tokens per n-gram (shorter eval questions: whole-text match)"
    )
    c.add_argument(
        "--min-overlap",
        type=float,
        default=0.5,
        help="fraction of one eval problem's n-grams found in a record that flags the record",
    )
    c.set_defaults(fn=_cmd_contamination)

    ln = io("length", "drop records with too many tokens")
    ln.add_argument("--max-prompt-tokens", type=int, required=True)
    ln.add_argument("--max-answer-tokens", type=int)
    ln.add_argument("--tokenizer", default="chars")
    ln.set_defaults(fn=_cmd_length)

    pf = io("prefilter", "keep prompts with a pass rate strictly between the bounds")
    pf.add_argument("--sampler", required=True, help="MODULE:FACTORY or FILE.py:FACTORY")
    pf.add_argument("--sampler-arg", action="append", default=[], help="KEY=VALUE passed to the factory")
    pf.add_argument("--n", type=int, default=8)
    pf.add_argument("--lower", type=float, default=0.0)
    pf.add_argument("--upper", type=float, default=1.0)
    pf.add_argument("--batch-size", type=int, default=64)
    pf.add_argument("--verifier-config", help="YAML verifier config (default: the built-in routes)")
    pf.set_defaults(fn=_cmd_prefilter)

    b = sub.add_parser("buckets", help="split a pre-filtered set into difficulty buckets")
    b.add_argument("inp", metavar="IN")
    b.add_argument("outdir", metavar="OUTDIR")
    b.add_argument("--edges", default="0.25,0.5,0.75")
    b.set_defaults(fn=_cmd_buckets)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ValueError as e:  # bad input (DatasetError included): one clear line, exit 2
        print(f"rlax curate {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
