"""``python -m swiftune.cli COMMAND ...``: the ``swiftune`` command, for launchers that start a
module (``torchrun -m swiftune.cli sft ...``, ``accelerate launch -m swiftune.cli grpo ...``)."""

import sys

from . import main

sys.exit(main())
