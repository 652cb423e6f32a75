"""TRACE-A rollout budget allocation: exact batched solvers and the allocator registry.

* `root_value`, `allocate_roots` — stage 1, global root allocation (docs/design.md §3.2).
* `prefix_value`, `allocate_prefixes` — stage 2, prefix expansion per prompt or
  with a global pool (docs/design.md §3.3).
* `ALLOCATORS`, `build_allocator`, `Allocator` — uniform | pcl | treepo | trace |
  trace_global, all spending the same number of trajectories per step, and `dapo`
  (`DapoAllocator`: DAPO's dynamic sampling in rounds, at most that number).
"""

from trace_mega.allocation.allocators import ALLOCATORS, Allocator, build_allocator  # noqa: E402 (after the solvers)
from trace_mega.allocation.dapo import DapoAllocator  # registers `dapo`
from trace_mega.allocation.prefix import allocate_prefixes, flip_probability, prefix_value
from trace_mega.allocation.root import allocate_roots, root_value

__all__ = [
    "root_value",
    "allocate_roots",
    "prefix_value",
    "flip_probability",
    "allocate_prefixes",
    "ALLOCATORS",
    "Allocator",
    "build_allocator",
    "DapoAllocator",
]
