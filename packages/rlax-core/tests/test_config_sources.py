"""Run configs that build on each other (`base:`), and `rlax config show`'s provenance."""

from __future__ import annotations

import pathlib

import pytest

from rlax_core.config import ConfigError, load_config, load_config_with_sources, render_config
from rlax_core.config.show import main as config_main

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "configs"


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_file_builds_on_its_bases_in_order_and_its_own_keys_win(tmp_path: pathlib.Path) -> None:
    _write(tmp_path / "shared/a.yaml", "data: {group_size: 4, prompts_per_step: 2}\ntrainer: {k: 1}\n")
    _write(tmp_path / "shared/b.yaml", "data: {group_size: 6}\n")
    run = _write(
        tmp_path / "run.yaml",
        "base: [shared/a.yaml, shared/b.yaml]\ntrainer: {k: 3, optimizer: {lr: 2.0e-5}}\n",
    )
    config, sources = load_config_with_sources(run, ["data.prompts_per_step=5"])
    assert (config.data.group_size, config.data.prompts_per_step) == (6, 5)
    assert config.trainer.k == 3 and config.trainer.optimizer.lr == 2e-5
    assert sources["data.group_size"] == str(tmp_path / "shared/b.yaml")
    assert sources["data.prompts_per_step"] == "override"
    assert sources["trainer.k"] == sources["trainer.optimizer.lr"] == str(run)


def test_a_file_sets_its_task_args_whole_over_its_bases(tmp_path: pathlib.Path) -> None:
    """The long-tail config sorts digits on the arithmetic demo's base: the demo's
    `digits: 1` must not reach the sorting task (it has no such field)."""
    _write(tmp_path / "base.yaml", "data: {task: arithmetic, task_args: {digits: 1}, group_size: 4}\n")
    run = _write(tmp_path / "run.yaml", "base: base.yaml\ndata: {task: sorting, task_args: {length: 3}}\n")
    config, sources = load_config_with_sources(run, [])
    assert config.data.task_args == {"length": 3} and config.data.group_size == 4
    assert sources["data.task_args.length"] == str(run) and "data.task_args.digits" not in sources
    shipped = load_config(CONFIGS / "long-tail-demo.yaml", [])
    assert shipped.data.task_args == {"length": 2, "max_length": 24, "tail": 1.2}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"run.yaml": "base: run.yaml\n"}, "include each other"),
        ({"run.yaml": "base: other.yaml\n", "other.yaml": "base: run.yaml\n"}, "include each other"),
        ({"run.yaml": "base: missing.yaml\n"}, "cannot read config file .*missing.yaml"),
        ({"run.yaml": "base: {a: 1}\n"}, "`base:` must be a file path or a list of file paths"),
        ({"run.yaml": "base: [ok.yaml, 3]\n", "ok.yaml": "{}\n"}, "`base:` must be a file path"),
    ],
)
def test_bad_bases_are_errors_that_name_the_file(tmp_path: pathlib.Path, files: dict, message: str) -> None:
    for name, text in files.items():
        _write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "run.yaml")


def test_every_objective_preset_config_is_the_shared_base_plus_its_preset() -> None:
    base = load_config(CONFIGS / "preset-base.yaml")
    for path in sorted((CONFIGS / "presets").glob("*.yaml")):
        config = load_config(path)
        assert config.trainer.preset == path.stem
        assert config.model == base.model and config.trainer.optimizer == base.trainer.optimizer
        assert len(path.read_text().splitlines()) <= 12, f"{path.name} repeats its base"


def test_show_names_the_source_of_every_value(tmp_path: pathlib.Path) -> None:
    _write(tmp_path / "base.yaml", "run: {steps: 9}\n")
    run = _write(
        tmp_path / "run.yaml", "base: base.yaml\ntrainer: {preset: dapo, objective: {kl: {coef: 0.5}}}\n"
    )
    config, sources = load_config_with_sources(run, ["trainer.k=5"])
    shown = {
        line.split("#")[0].strip(): line.split("#")[-1].strip()
        for line in render_config(config, sources).splitlines()
        if "#" in line
    }
    assert shown["steps: 9"] == str(tmp_path / "base.yaml")
    assert shown["preset: dapo"] == str(run)
    assert shown["coef: 0.5"] == str(run)  # the run's objective override ...
    assert shown["eps_high: 0.28"] == "preset dapo"  # ... over the preset's fields
    assert shown["k: 5"] == "override"
    assert shown["seed: 0"] == "default"
    # Every option of the config is shown, each once with a source.
    assert sum(1 for line in render_config(config, sources).splitlines() if "#" in line) >= 100


def test_rlax_config_show_prints_the_tree_and_rejects_a_bad_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert config_main(["show", str(CONFIGS / "demo.yaml"), "trainer.k=3"]) == 0
    out = capsys.readouterr().out
    assert "  k: 3" in out and "# override" in out and f"# {CONFIGS / 'demo.yaml'}" in out
    assert config_main(["show", "trainer.lr=1"]) == 78
    assert "it is `trainer.optimizer.lr` now" in capsys.readouterr().err
