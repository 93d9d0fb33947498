import pathlib
import sys

# --import-mode=importlib does not put test folders on sys.path; our helpers live here.
_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import pytest  # noqa: E402

from rlax_core.testing import LoopThread  # noqa: E402


@pytest.fixture
def loop_thread() -> type[LoopThread]:
    return LoopThread
