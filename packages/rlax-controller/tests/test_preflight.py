"""The preflight's component checks leave nothing behind in the folder `rlax launch` runs in."""

from __future__ import annotations

import pathlib
import tempfile

import pytest

from rlax_controller import preflight
from rlax_controller.preflight import check_components
from rlax_controller.process_plan import resolve_addresses
from rlax_core.config import ConfigError, load_config


def test_a_preflight_run_leaves_nothing_in_the_current_folder(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd, temp = tmp_path / "cwd", tmp_path / "temp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    written: list[pathlib.Path] = []

    def dump_and_note(config: object, path: pathlib.Path) -> pathlib.Path:
        written.append(path)
        return preflight_dump(config, path)

    preflight_dump = preflight.dump_config
    monkeypatch.setattr(preflight, "dump_config", dump_and_note)
    # An output folder whose parent does not exist yet: the checks once wrote into the cwd then.
    output = f"run.output_dir={tmp_path / 'runs' / 'one'}"
    check_components(resolve_addresses(load_config(None, [output])), [("controller", [])])
    rejected = resolve_addresses(load_config(None, [output, "model.max_seq_len=3"]))
    with pytest.raises(ConfigError, match="no room to generate"):
        check_components(rejected, [("controller", [])])
    # While the checks ran, their config lay in the system's temporary folder; then it went.
    assert len(written) == 2 and all(path.is_relative_to(temp) for path in written), written
    assert list(cwd.iterdir()) == [] and list(temp.iterdir()) == []
