"""``python -m swiftune COMMAND ...``: the ``swiftune`` command (see :mod:`swiftune.cli`)."""

import sys

from swiftune.cli import main

sys.exit(main())
