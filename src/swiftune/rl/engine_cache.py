"""Deprecated alias of swiftune.rl.rollout.kv_cache; removed after the next release."""

from .rollout.kv_cache import DecodeContext, Workspace

__all__ = ["DecodeContext", "Workspace"]
