"""``python -m swiftune.rl [CONFIG.yaml] [--key value ...]``: the same as ``swiftune grpo``."""

import sys

from .builtin import main

sys.exit(main())
