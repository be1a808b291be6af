"""Deprecated alias of swiftune.rl.rollout.fast; removed after the next release."""

import sys

from .rollout import fast as _fast

# The old name is the new module itself, not a copy of its names: callers that patch a module
# attribute through the old path (tests replace ``prenorm_layers``) then patch what the engine calls.
sys.modules[__name__] = _fast
