"""How often CUDA graph trees record a compiled function's graph again.

inductor's ``cudagraph_skips`` counts the graphs it runs without CUDA graphs; it does not count
the graphs it records again. A tree replays a recorded graph only while the graph's inputs keep
their invariants (a static input at its recorded address, an input from another graph's pool
where it was); otherwise it records the function anew: a synchronize, the function run eagerly
and captured, and a graph more kept. A step that does that on every call runs slower than no CUDA
graph at all, and nothing says so. ``GraphRecords`` counts each function's recordings and keeps
the tree's reason each time one is recorded again. The GPU benches install one for the process
(``install``, without the reasons; their rows' ``cudagraph_recorded_again_so_far``), test_cuda.py
one per test, with them."""

from __future__ import annotations

import collections
import weakref

from torch._inductor import cudagraph_trees


class GraphRecords:
    """The recordings of each compiled function by the CUDA graph trees, from when its patches are
    applied on: ``recorded`` counts them per tree and function, ``again`` those of a function
    recorded before, ``reasons`` says for each of those why its graph could not be replayed (the
    tree's last failed check, in inductor's words, with the function's name)."""

    def __init__(self):
        # per tree (a tree manager, one per device; torch._dynamo.reset makes new ones): per function
        self.recorded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.again = 0
        self.reasons: list[str] = []
        self._last_failure: dict[int, str] = {}  # per device: its tree's latest failed check, until a recording

    def patches(self, reasons: bool = True) -> list[tuple[type, str, object]]:
        """(class, attribute, replacement) for each method to patch: the tree manager's
        ``record_function`` and, with ``reasons``, a node's ``check_invariants`` (which every
        replay calls: a wrapper there costs each replay a Python call), each wrapping the method
        the class has now."""
        manager, node = cudagraph_trees.CUDAGraphTreeManager, cudagraph_trees.CUDAGraphNode
        record, check = manager.record_function, node.check_invariants

        def counted_record(tree, new_inputs, function_id):
            counts = self.recorded.setdefault(tree, collections.Counter())
            failure = self._last_failure.pop(tree.device_index, "no failed check")
            if counts[function_id.id]:
                self.again += 1
                self.reasons.append(f"{tree.get_func_name(function_id)}: {failure}")
            counts[function_id.id] += 1
            return record(tree, new_inputs, function_id)

        def kept_failure(graph_node, inputs):
            status, describe = check(graph_node, inputs)
            if status != cudagraph_trees.CheckInvariantStatus.SUCCESS:
                self._last_failure[graph_node.device] = f"{status}: {describe()}"
            else:  # (a graph replayed: an earlier failure explains no later recording)
                self._last_failure.pop(graph_node.device, None)
            return status, describe

        return [(manager, "record_function", counted_record)] + [(node, "check_invariants", kept_failure)] * reasons


_PROCESS: GraphRecords | None = None  # install's


def install() -> GraphRecords:
    """Counts the process's recordings from now on (once: later calls return the same counter),
    without their reasons: the benches time the replays, which the reasons' wrapper would slow."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = GraphRecords()
        for owner, name, replacement in _PROCESS.patches(reasons=False):
            setattr(owner, name, replacement)
    return _PROCESS


def recorded_again() -> int | None:
    """The recordings of a function recorded before, in this process since ``install`` (None
    before it: not counted)."""
    return None if _PROCESS is None else _PROCESS.again


def reasons_again() -> list[str]:
    """Each of those recordings by its function's name (GraphRecords.reasons, "no failed check"
    for the why: install keeps none; none before ``install``)."""
    return [] if _PROCESS is None else list(_PROCESS.reasons)
