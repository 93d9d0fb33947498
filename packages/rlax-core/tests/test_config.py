from __future__ import annotations

import pathlib

import pytest
import yaml

from rlax_core.config import ConfigError, RunConfig, dump_config, load_config, parse_config


def write(tmp_path: pathlib.Path, data: object) -> pathlib.Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_are_valid() -> None:
    config = load_config(None)
    assert isinstance(config, RunConfig)
    assert config.batch_size == config.data.prompts_per_step * config.data.group_size


def test_yaml_and_dotted_overrides(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, {"run": {"name": "x", "steps": 3}, "trainer": {"preset": "dapo"}})
    config = load_config(
        path, ["trainer.optimizer.lr=1e-6", "chaos.interval=5", "workers.count=3", "data.dynamic_filter=true"]
    )
    assert config.run.steps == 3 and config.trainer.preset == "dapo"
    assert config.trainer.optimizer.lr == pytest.approx(1e-6)
    assert config.chaos.interval == 5.0
    assert config.workers.count == 3
    assert config.data.dynamic_filter is True


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("workers.count=0", ["workers.count", "0"]),
        ("trainer.optimizer.lr=-1", ["trainer.optimizer.lr", "-1"]),
        ("trainer.preset=foo", ["trainer.preset", "foo"]),
        ("trainer.k=abc", ["trainer.k", "abc"]),
        ("trainer.bogus=1", ["trainer.bogus", "unknown"]),
        ("nosuch.x=1", ["nosuch", "unknown"]),
        ("controller.address=http://x", ["controller.address", "http://x"]),
        ("eval.pass_k=[1,99]", ["eval.pass_k[1]", "99"]),
    ],
)
def test_bad_values_name_field_and_value(override: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    for needle in needles:
        assert needle in message, message


def test_reload_staleness_beyond_k_plus_one_is_refused() -> None:
    # k=0 with j=4 used to launch and then regenerate stale groups forever (no step after
    # the first); the bound is j <= k + 1 (batch s needs version >= s - k, the newest is s).
    with pytest.raises(ConfigError) as info:
        load_config(None, ["workers.j=4", "trainer.k=0"])
    message = str(info.value)
    assert "workers.j = 4" in message and "trainer.k + 1 = 1" in message and "{" not in message
    with pytest.raises(ConfigError, match="workers.j = 3"):
        load_config(None, ["workers.j=3", "trainer.k=1"])
    assert load_config(None, ["workers.j=2", "trainer.k=1"]).workers.j == 2
    assert load_config(None, ["workers.j=1", "trainer.k=0"]).trainer.k == 0


def test_bad_yaml_file_and_types(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="mapping"):
        parse_config([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["trainer.optimizer.lr"])


def test_dump_and_reload_round_trip(tmp_path: pathlib.Path) -> None:
    config = load_config(None, ["run.name=rt", "workers.j=4", "trainer.k=8"])
    path = dump_config(config, tmp_path / "resolved.yaml")
    assert load_config(path) == config


def test_a_reader_finds_a_live_runs_versions_in_memory_and_a_stopped_runs_in_its_state_dir(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rlax_core.config.paramserver_folders as config_module

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(config_module, "MEMORY_ROOT", shm)
    config = load_config(None, [f"run.output_dir={tmp_path / 'run'}", "paramserver.storage=memory"])
    live, rest = config_module.paramserver_dirs(config)
    assert live.parent == shm and rest == tmp_path / "run" / "paramserver"
    assert config_module.published_state_dir(config) == rest  # stopped: nothing in memory
    live.mkdir()
    (live / "weights-v000000000007.rlaxw").write_bytes(b"")
    assert config_module.published_state_dir(config) == live
    on_disk = load_config(None, [f"run.output_dir={tmp_path / 'run'}"])
    assert config_module.paramserver_dirs(on_disk) == (rest, None)
    assert config_module.published_state_dir(on_disk) == rest
    monkeypatch.setattr(config_module, "MEMORY_MIN_FREE_BYTES", 1 << 60)  # a container's 64 MB /dev/shm
    assert config_module.paramserver_dirs(config) == (live, rest), "a live run's folder is always used"
    (live / "weights-v000000000007.rlaxw").unlink()
    live.rmdir()
    assert config_module.paramserver_dirs(config) == (rest, None)
    monkeypatch.setattr(config_module, "MEMORY_MIN_FREE_BYTES", 0)
    monkeypatch.setattr(config_module, "MEMORY_ROOT", tmp_path / "no-such-folder")  # macOS: no /dev/shm
    assert config_module.paramserver_dirs(config) == (rest, None)


PARTIAL = ["workers.on_new_version=interrupt", "controller.lag=2", "trainer.k=2", "data.max_new_tokens=12"]


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("controller.lag=1", ["controller.lag", "must be >= workers.segment_newest_lag + 1 = 2"]),
        ("controller.versions=freshest", ["controller.versions", "must be pinned"]),
        ("agent.environment=calculator", ["agent.enabled", "single-turn"]),
        ("workers.segment_tokens=12", ["workers.segment_tokens", "no sample would be interrupted"]),
        ("workers.segment_tokens=-1", ["workers.segment_tokens", ">= 0"]),
        ("workers.segment_newest_lag=2", ["controller.lag", "must be >= workers.segment_newest_lag + 1 = 3"]),
        ("workers.segment_newest_lag=0", ["workers.segment_newest_lag", ">= 1"]),
    ],
)
def test_partial_rollouts_refuse_what_they_cannot_schedule(override: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*PARTIAL, override])
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_kept_kv_is_for_partial_rollouts_only() -> None:
    assert load_config(None, [*PARTIAL, "workers.resume_kv=keep"]).workers.resume_kv == "keep"
    assert load_config(None, []).workers.resume_kv == "recompute"
    with pytest.raises(ConfigError, match="workers.resume_kv.*needs workers.on_new_version: interrupt"):
        load_config(None, ["workers.resume_kv=keep"])
    with pytest.raises(ConfigError, match="workers.resume_kv"):
        load_config(None, [*PARTIAL, "workers.resume_kv=stale"])


def test_partial_rollout_segments_default_to_the_lag_s_share_of_the_new_tokens() -> None:
    assert load_config(None, PARTIAL).partial_segment_tokens == 6
    widest = load_config(None, [*PARTIAL, "controller.lag=-1", "trainer.k=4", "paramserver.keep=8"])
    assert widest.pinned_lag == 4 and widest.partial_segment_tokens == 3
    assert load_config(None, [*PARTIAL, "workers.segment_tokens=5"]).partial_segment_tokens == 5
    # lag 4 with the newest segment at s - 2: versions s - 4 .. s - 2, three shares
    overlapped = [
        *PARTIAL,
        "controller.lag=4",
        "trainer.k=4",
        "paramserver.keep=8",
        "workers.segment_newest_lag=2",
    ]
    assert load_config(None, overlapped).partial_segment_tokens == 4
    assert load_config(None, []).workers.on_new_version == "finish"


@pytest.mark.parametrize(
    ("overrides", "ahead"),
    [
        (["controller.lag=0"], 1),  # synchronous: nothing can start early, one batch queued
        (["controller.lag=1", "trainer.k=1"], 1),
        (["controller.lag=2", "trainer.k=2"], 2),  # as far as the pinned versions allow
        (["controller.lag=-1", "trainer.k=4", "paramserver.keep=8"], 4),
        (["controller.lag=2", "trainer.k=2", "controller.lookahead_steps=1"], 1),  # as set
        (["controller.lag=2", "trainer.k=2", "controller.lookahead_steps=0"], 0),
        (["controller.versions=freshest", "trainer.k=4"], 1),  # no pinned lag to follow
    ],
)
def test_the_lookahead_follows_the_pinned_lag_unless_set(overrides: list[str], ahead: int) -> None:
    assert load_config(None, overrides).lookahead_steps == ahead


def test_a_lookahead_below_minus_one_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="controller.lookahead_steps"):
        load_config(None, ["controller.lookahead_steps=-2"])
