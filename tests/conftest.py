import pathlib
import sys

# --import-mode=importlib does not put test folders on sys.path; shared helpers live here.
_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
