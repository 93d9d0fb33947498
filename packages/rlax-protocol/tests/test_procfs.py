import subprocess
import sys

import pytest

from rlax_protocol.procfs import memory_mb


def test_memory_of_this_process_and_of_one_that_is_gone() -> None:
    rss, peak, pss = memory_mb(), memory_mb("self", "VmHWM"), memory_mb("self", "Pss")
    assert rss is not None and peak is not None and pss is not None
    assert 0 < rss <= peak and 0 < pss
    with pytest.raises(ValueError, match="VmRSSS"):
        memory_mb("self", "VmRSSS")  # a typo is an error, not 0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert memory_mb(gone.pid) is None
