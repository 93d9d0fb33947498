import pathlib
import sys

# Tests run with --import-mode=importlib, so helper modules beside them need this path entry.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
