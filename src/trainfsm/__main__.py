"""``python -m trainfsm``: the same as the ``trainfsm`` command."""

import sys

from trainfsm.cli import main

sys.exit(main())
