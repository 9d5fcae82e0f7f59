"""``python -m trainfsm``: the same as the ``trainfsm`` command."""

import sys

from trainfsm.tools.cli import main

sys.exit(main())
