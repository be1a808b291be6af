"""Deprecated alias of swiftune.rl.rollout.cuda_graphs; removed after the next release."""

from .rollout.cuda_graphs import DecodeGraphs

__all__ = ["DecodeGraphs"]
