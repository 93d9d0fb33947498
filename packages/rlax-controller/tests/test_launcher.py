from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from rlax_controller import launcher, local_backend
from rlax_controller.process_plan import build_specs, resolve_addresses, run_keys
from rlax_controller.run_report import SupervisorReport
from rlax_core.cli import main as rlax_main
from rlax_core.config import EXIT_CONFIG_ERROR, ConfigError, load_config
from rlax_protocol.control_messages import BatchRequest, decode_control, encode_control
from rlax_protocol.errors import ProtocolTimeoutError
from rlax_protocol.request_links import ControlClient

DEMO = pathlib.Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"


def test_invalid_config_is_rejected_before_any_process_starts(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "run.yaml"
    out = tmp_path / "out"
    config.write_text(f"run:\n  output_dir: {out}\nworkers:\n  count: 2\n")
    result = subprocess.run(
        [sys.executable, "-m", "rlax_core.cli", "launch", str(config), "trainer.k=-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_CONFIG_ERROR
    assert "trainer.k = -1" in result.stderr and "must be >= 0" in result.stderr
    assert not out.exists()  # nothing was started, nothing written


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        # Each passes the run config's own checks; the component named rejects it.
        ("trainer.micro_batch=5", ["the trainer", "micro_batch=5 must divide the 32 rollouts"]),
        # Two more trainer refusals, ~18 s each (a trainer process checks them): `nox -s slow`.
        pytest.param(
            "trainer.minibatches=3",
            ["the trainer", "minibatches=3 must divide global_batch=32"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "trainer.objective={no_such_term: 1}", ["the trainer", "no_such_term"], marks=pytest.mark.slow
        ),
        ("workers.attention=fast", ["workers.*", "EngineConfig.attention", "'fast'"]),
        ("data.task=no_such_task", ["the task (data.*)", "no_such_task"]),
        # Arithmetic prompts take up to 7 tokens: the engine would refuse them all.
        ("model.max_seq_len=6", ["model.max_seq_len = 6", "tokens (no room to generate)"]),
    ],
)
def test_config_a_component_rejects_stops_the_launch_before_any_process_starts(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, override: str, needles: list[str]
) -> None:
    out = tmp_path / "out"

    def no_supervisor(*args: object, **kwargs: object) -> None:
        raise AssertionError("rlax launch started processes with a config a component rejects")

    monkeypatch.setattr(local_backend, "Supervisor", no_supervisor)
    with pytest.raises(ConfigError) as info:
        launcher.launch(None, [f"run.output_dir={out}", override])
    for needle in needles:
        assert needle in str(info.value)
    assert not out.exists()  # nothing was started, nothing written


# Issue 29: `trainer.platform=tpu` on a CPU machine trained on the CPU and exited 0 (JAX was
# imported before JAX_PLATFORMS was set); `trainer.mesh={fsdp: 3}` on two devices started
# every component before the trainer rejected it. Two CPU devices, whatever the caller set.
ABSENT = [
    ("trainer.platform=tpu", ["trainer.platform = 'tpu'", "JAX cannot start that platform"]),
    ("trainer.mesh={fsdp: 3}", ["trainer.mesh = {'fsdp': 3}", "3 devices", "2 device(s) of platform 'cpu'"]),
]
TWO_CPUS = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


# The launch test takes the platform case; the mesh case runs in `nox -s slow` (the trainer
# process's own refusal of both runs below, in the default suite).
@pytest.mark.parametrize(
    ("override", "needles"), [ABSENT[0], pytest.param(*ABSENT[1], marks=pytest.mark.slow)]
)
def test_a_platform_or_mesh_this_machine_lacks_stops_rlax_launch_before_any_process_starts(
    tmp_path: pathlib.Path, override: str, needles: list[str]
) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "rlax_core.cli", "launch", str(DEMO), f"run.output_dir={out}", override],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **TWO_CPUS},
    )
    assert result.returncode == EXIT_CONFIG_ERROR, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, result.stderr[-3000:]
    assert not out.exists()  # no logs/ folder: no component was started


@pytest.mark.parametrize(("override", "needles"), ABSENT)
def test_the_trainer_process_itself_refuses_a_platform_or_mesh_this_machine_lacks(
    tmp_path: pathlib.Path, override: str, needles: list[str]
) -> None:
    """Started by hand (or by a launcher that skipped the preflight), the trainer exits with
    the config error code before it trains anything."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_core.cli",
            "trainer",
            "--config",
            str(DEMO),
            f"run.output_dir={tmp_path}",
            override,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **TWO_CPUS},
    )
    assert result.returncode == EXIT_CONFIG_ERROR, result.stderr[-3000:]
    assert "rlax trainer: invalid config" in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "checkpoints").exists()


def test_launch_of_a_valid_config_passes_every_component_check(tmp_path: pathlib.Path) -> None:
    from rlax_controller.preflight import validate_components

    validate_components(resolve_addresses(load_config(None, [f"run.output_dir={tmp_path}"])))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trainer", "--config", "{config}", "trainer.micro_batch=5"], "micro_batch=5 must divide"),
        (
            ["worker", "--config", "{config}", "--index", "0", "workers.attention=fast"],
            "EngineConfig.attention",
        ),
        (["worker", "--config", "{config}", "--index", "7"], "--index 7"),
        (["controller", "--config", "{config}", "model.max_seq_len=3"], "no room to generate"),
        (["paramserver", "--bind", "tcp://127.0.0.1:9", "--state-dir", "{file}"], "is a file"),
    ],
)
def test_a_component_whose_config_is_rejected_exits_with_the_config_error_code(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"run:\n  output_dir: {tmp_path / 'out'}\nworkers:\n  count: 1\n  addresses: [tcp://127.0.0.1:9]\n"
    )
    command, *rest = (arg.format(file=a_file, config=config) for arg in argv)
    try:
        code = rlax_main([command, *rest])
    except SystemExit as stop:  # the parameter server exits from its argument parser
        code = stop.code
    assert code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    prog = "rlax-paramserver" if command == "paramserver" else f"rlax {command}"
    assert f"{prog}: invalid config" in err and needle in err
    assert not (tmp_path / "out").exists()


def test_unknown_key_in_yaml_is_named(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  learning_rate: 0.1\n")
    result = subprocess.run(
        [sys.executable, "-m", "rlax_core.cli", "launch", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        result.returncode == EXIT_CONFIG_ERROR
        and "unknown config field `trainer.learning_rate`" in result.stderr
    )


def test_resolve_addresses_and_process_specs(tmp_path: pathlib.Path) -> None:
    config = resolve_addresses(load_config(None, ["workers.count=3", "verifier.mode=service"]))
    addresses = [
        config.controller.address,
        config.paramserver.address,
        config.verifier.address,
        *config.workers.addresses,
    ]
    assert len(set(addresses)) == 6 and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    specs = build_specs(config, tmp_path / "config.yaml", run_keys(config))
    assert [s.role for s in specs] == [
        "paramserver",
        "verifier",
        "worker",
        "worker",
        "worker",
        "trainer",
        "controller",
    ]
    assert [s.name for s in specs if s.completes_run] == ["controller"]
    assert specs[2].argv[-4:] == ["--config", str(tmp_path / "config.yaml"), "--index", "0"]
    fixed = resolve_addresses(load_config(None, ["controller.address=tcp://10.0.0.5:7000"]))
    assert fixed.controller.address == "tcp://10.0.0.5:7000"


def test_a_parameter_server_in_memory_serves_from_dev_shm_and_rests_in_the_run(
    tmp_path: pathlib.Path,
) -> None:
    def argv(*overrides: str) -> list[str]:
        config = resolve_addresses(load_config(None, [f"run.output_dir={tmp_path / 'run'}", *overrides]))
        (spec,) = [s for s in build_specs(config, tmp_path / "config.yaml", None) if s.role == "paramserver"]
        return spec.argv

    def flag(args: list[str], name: str) -> str | None:
        return args[args.index(name) + 1] if name in args else None

    on_disk = argv()
    assert flag(on_disk, "--state-dir") == str(tmp_path / "run" / "paramserver")
    assert flag(on_disk, "--rest-dir") is None
    in_memory = argv("paramserver.storage=memory")
    live = flag(in_memory, "--state-dir")
    assert live is not None and live.startswith("/dev/shm/rlax-paramserver-")
    assert flag(in_memory, "--rest-dir") == str(tmp_path / "run" / "paramserver")
    # The same run finds its folder again; another run gets its own.
    assert flag(argv("paramserver.storage=memory"), "--state-dir") == live
    other = argv("paramserver.storage=memory", f"paramserver.state_dir={tmp_path / 'elsewhere'}")
    assert flag(other, "--state-dir") != live


def test_unreachable_controller_gives_a_timeout_error_naming_peer_and_operation() -> None:
    client = ControlClient("tcp://127.0.0.1:9", encode=encode_control, decode=decode_control, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ProtocolTimeoutError) as info:
        client.call(BatchRequest(trainer_step=0))
    assert time.monotonic() - started < 5
    assert "controller tcp://127.0.0.1:9" in str(info.value) and "Hello" in str(info.value)
    client.close()


def test_worker_with_unreachable_parameter_server_fails_with_a_clear_timeout(
    tmp_path: pathlib.Path, toy
) -> None:
    overrides = [
        f"run.output_dir={tmp_path}",
        f"paramserver.address=tcp://127.0.0.1:{toy.port()}",  # nothing listens there
        f"workers.addresses=[tcp://127.0.0.1:{toy.port()}]",
        "workers.count=1",
        "controller.request_timeout_s=2",
    ]
    config = tmp_path / "run.yaml"
    config.write_text("run:\n  name: unreachable\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_core.cli",
            "worker",
            "--config",
            str(config),
            "--index",
            "0",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert "no answer from the parameter server at tcp://127.0.0.1:" in result.stderr


def test_rlax_launch_exits_with_the_config_error_code_when_a_component_rejected_its_config(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def stopped_by_a_config_error(*args: object, **kwargs: object) -> SupervisorReport:
        return SupervisorReport(False, "trainer rejected its configuration", {}, [], {}, tmp_path, True)

    monkeypatch.setattr(launcher, "launch", stopped_by_a_config_error)
    assert rlax_main(["launch", str(tmp_path / "run.yaml")]) == EXIT_CONFIG_ERROR
