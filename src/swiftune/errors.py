"""Errors that swiftune's library code raises instead of ending the process.

Only the ``swiftune`` command (:mod:`swiftune.cli`) turns an error into a printed line and an exit
status; everything below it raises, so that a notebook, a test or another program calling swiftune
keeps running and can catch what went wrong.

A leaf: imports nothing, so that any layer may raise these.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that swiftune cannot run with. The message names the setting (a config field or a
    command-line option), the value given and what to change it to.

    A ``ValueError``, so that callers catching ``ValueError`` for a bad value keep working.
    """
