import sys

from rlax_paramserver.cli import main

sys.exit(main())
