"""Rollout trees, the ReAct agent loop, and generation engines."""

from trace_mega.rollout.tree import FlatPaths, Node, PackedTrees, RolloutTree, pack

__all__ = ["FlatPaths", "Node", "PackedTrees", "RolloutTree", "pack"]
