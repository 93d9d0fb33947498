"""Loaded first by every pytest run of the monorepo.

Our kernels' tests live under the folder `kernels/`, so `--import-mode=importlib` names their
modules `kernels.tests.test_*` and puts an empty `kernels` module into `sys.modules`. The
Hugging Face package of the same import name, which transformers (>= 5.25) imports when it is
installed, would then resolve to that empty module (`cannot import name 'CUDAProperties'
from 'kernels' (unknown location)`). Importing the real one first keeps it there: pytest only
fills in parent modules that are missing.
"""

import importlib.util

_HUB_KERNELS = importlib.util.find_spec("kernels")
if _HUB_KERNELS is not None and _HUB_KERNELS.origin:  # a regular package, not our folder
    import kernels  # noqa: F401  (the Hugging Face package, not this repository's folder)
