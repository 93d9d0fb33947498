"""Config validation and the command line."""

from __future__ import annotations

import pathlib

import pytest

from rlax_paramserver import ServerConfig
from rlax_paramserver.paramserver_process import parse_config


@pytest.mark.parametrize(
    ("field", "value"),
    [("keep", 0), ("workers", 0), ("lease_ttl_s", 0.0), ("bind", "localhost"), ("max_message_bytes", -1)],
)
def test_bad_field_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"ServerConfig\.{field}={value!r}"):
        ServerConfig(**{field: value})


def test_cli_flags(tmp_path, capsys) -> None:
    config, ready, level = parse_config(
        ["--bind", "tcp://127.0.0.1:6000", "--keep", "5", "--state-dir", str(tmp_path), "--lease-ttl", "3"]
    )
    assert config.bind == "tcp://127.0.0.1:6000" and config.keep == 5 and config.lease_ttl_s == 3.0
    assert config.state_dir == pathlib.Path(tmp_path) and ready is None and level == "INFO"
    with pytest.raises(SystemExit):
        parse_config(["--keep", "0"])
    assert "ServerConfig.keep=0" in capsys.readouterr().err
