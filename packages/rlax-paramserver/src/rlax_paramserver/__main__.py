import sys

from rlax_paramserver.paramserver_process import main

sys.exit(main())
