from __future__ import annotations

import json
import textwrap

from rlax_data import load_jsonl
from rlax_data.curation.cli import main


def test_generate_dedup_length_prefilter_buckets(tmp_path):
    data = tmp_path / "arith.jsonl"
    assert main(["generate", "arithmetic", str(data), "-n", "200", "--seed", "3"]) == 0
    recs = load_jsonl(data).records
    assert len(recs) == 200

    dup = tmp_path / "dup.jsonl"
    dup.write_text(data.read_text() + data.read_text().replace('"id":"arithmetic-', '"id":"copy-'))
    dedup_out = tmp_path / "dedup.jsonl"
    assert main(["dedup", str(dup), str(dedup_out), "--exact-only"]) == 0
    unique_prompts = len({r.prompt for r in recs})
    assert len(load_jsonl(dedup_out)) == unique_prompts
    report = json.loads((tmp_path / "dedup.jsonl.report.json").read_text())
    assert report["total"] == 400 and report["kept"] == unique_prompts

    short = tmp_path / "short.jsonl"
    assert main(["length", str(dedup_out), str(short), "--max-prompt-tokens", "5"]) == 0
    assert all(len(r.prompt) <= 5 for r in load_jsonl(short))

    sampler_file = tmp_path / "my_sampler.py"
    sampler_file.write_text(
        textwrap.dedent(
            """
            def make(modulus="3"):
                m = int(modulus)

                def sample(prompts, n):
                    out = []
                    for p in prompts:
                        a, b = p.rstrip("=").split("+")
                        right = str(int(a) + int(b))
                        k = (int(a) % m)  # prompt p is right in k of every m samples
                        out.append([right if j % m < k else "x" for j in range(n)])
                    return out

                return sample
            """
        )
    )
    curated = tmp_path / "curated.jsonl"
    rc = main(
        [
            "prefilter",
            str(data),
            str(curated),
            "--sampler",
            f"{sampler_file}:make",
            "--sampler-arg",
            "modulus=3",
        ]
        + ["--n", "6", "--lower", "0", "--upper", "1"]
    )
    assert rc == 0
    kept = load_jsonl(curated).records
    want = [
        r.id for r in recs if int(r.prompt.split("+")[0]) % 3 == 1 or int(r.prompt.split("+")[0]) % 3 == 2
    ]
    assert [r.id for r in kept] == want
    rep = json.loads((tmp_path / "curated.jsonl.report.json").read_text())
    assert rep["kept"] == len(want) and rep["too_hard"] == 200 - len(want) and rep["too_easy"] == 0

    bdir = tmp_path / "buckets"
    assert main(["buckets", str(curated), str(bdir), "--edges", "0.5"]) == 0
    summary = json.loads((bdir / "buckets.json").read_text())
    assert summary["bucket0.jsonl"]["pass_rate"] == "[0.50, 1.00]"
    n_easy = sum(int(r.prompt.split("+")[0]) % 3 == 2 for r in recs)
    assert (
        summary["bucket0.jsonl"]["records"] == n_easy
        and len(load_jsonl(bdir / "bucket1.jsonl")) == len(want) - n_easy
    )


def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n')
    assert main(["dedup", str(bad), str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1:" in err and "field `answer`" in err
    assert main(["prefilter", str(bad), str(tmp_path / "o.jsonl"), "--sampler", "nope"]) == 2


def test_generate_takes_task_fields_and_prefilter_hands_a_samplers_renderer_the_records(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    args = ["generate", "tool_arithmetic", str(data), "-n", "12", "--seed", "1"]
    assert main([*args, "--task-arg", "style=chat", "--task-arg", "digits_b=3"]) == 0
    recs = load_jsonl(data).records
    assert all(r.prompt.startswith("What is ") and len(r.prompt.split(" * ")[1]) == 4 for r in recs)
    # A sampler with a `render` (an agent loop needs the record, not just its prompt text)
    # gets each record rendered by it; this one answers right once in two where the value is even.
    sampler_file = tmp_path / "record_sampler.py"
    sampler_file.write_text(
        textwrap.dedent(
            """
            import json

            def make():
                def sample(prompts, n):
                    records = [json.loads(p) for p in prompts]
                    even = [int(r["metadata"]["value"]) % 2 == 0 for r in records]
                    return [[r["answer"] if e and j == 0 else "no" for j in range(n)] for r, e in zip(records, even)]

                sample.render = lambda record: json.dumps(
                    {"answer": record.answer, "metadata": dict(record.metadata)}
                )
                return sample
            """
        )
    )
    curated = tmp_path / "curated.jsonl"
    filt = ["--n", "2", "--lower", "0", "--upper", "1"]
    assert main(["prefilter", str(data), str(curated), "--sampler", f"{sampler_file}:make", *filt]) == 0
    assert [r.id for r in load_jsonl(curated)] == [r.id for r in recs if int(r.metadata["value"]) % 2 == 0]
    # A field the task lacks, or a value it rejects, names the option.
    assert main([*args, "--task-arg", "colour=red"]) == 2
    assert main([*args, "--task-arg", "style=loud"]) == 2
    err = capsys.readouterr().err
    assert "--task-arg" in err and "colour" in err and "field `style`" in err
