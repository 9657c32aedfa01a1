"""bench/cuda_graph_records.py's counting, on stand-ins for the tree's methods (CUDA graph trees
record nothing without a GPU; there test_cuda.py uses it on real recordings): a function recorded
a second time counts once as "again", with the tree's last failed check as its reason; a tree
made anew (torch._dynamo.reset), whose function ids start over, does not."""

import pytest
from torch._inductor import cudagraph_trees

from bench import cuda_graph_records
from bench.cuda_graph_records import GraphRecords

MANAGER, NODE = cudagraph_trees.CUDAGraphTreeManager, cudagraph_trees.CUDAGraphNode
STATUS = cudagraph_trees.CheckInvariantStatus


class Tree:
    """Stands in for a CUDAGraphTreeManager (what the counting reads of it)."""

    def __init__(self, device_index: int):
        self.device_index = device_index

    def get_func_name(self, function_id) -> str:
        return f"step{function_id.id}"


class Node:
    """Stands in for a CUDAGraphNode."""

    def __init__(self, device: int):
        self.device = device


@pytest.fixture
def stand_ins(monkeypatch) -> list:
    """The tree's record_function and a node's check_invariants replaced by stand-ins: recording
    returns what it recorded; the checks fail with the statuses appended to the returned list, in
    order, then succeed."""
    statuses = []
    monkeypatch.setattr(MANAGER, "record_function", lambda tree, inputs, function_id: (tree, function_id.id))
    monkeypatch.setattr(NODE, "check_invariants",
                        lambda node, inputs: (statuses.pop(0) if statuses else STATUS.SUCCESS,
                                              lambda: "placeholder 3 moved"))
    return statuses


def test_a_function_recorded_again_counts_with_its_reason(stand_ins):
    records = GraphRecords()
    methods = {name: replacement for _, name, replacement in records.patches()}
    record, check = methods["record_function"], methods["check_invariants"]
    tree, step, other = Tree(0), cudagraph_trees.FunctionID(0), cudagraph_trees.FunctionID(1)
    assert record(tree, [], step) == (tree, 0)  # (the original's result, passed through)
    record(tree, [], other)
    assert check(Node(0), [])[0] == STATUS.SUCCESS  # a replay: nothing kept
    assert records.again == 0 and records.reasons == []
    stand_ins.append(STATUS.StaticInputIdxMismatch)
    status, describe = check(Node(0), [])
    assert status == STATUS.StaticInputIdxMismatch and describe() == "placeholder 3 moved"
    record(tree, [], step)
    assert records.again == 1
    assert records.reasons == [f"step0: {STATUS.StaticInputIdxMismatch}: placeholder 3 moved"]
    assert records.recorded[tree] == {0: 2, 1: 1}
    stand_ins.append(STATUS.StaticInputIdxMismatch)
    check(Node(0), [])
    check(Node(0), [])  # (another node replayed after that failure)
    record(tree, [], other)  # recorded again with no failed check since the last replay
    assert records.again == 2 and records.reasons[-1] == "step1: no failed check"


def test_a_new_tree_starts_its_count_afresh(stand_ins):
    records = GraphRecords()
    record = {name: replacement for _, name, replacement in records.patches()}["record_function"]
    step, first, second = cudagraph_trees.FunctionID(0), Tree(0), Tree(0)
    record(first, [], step)
    record(second, [], step)  # another tree (as after torch._dynamo.reset): the same id, another function
    assert records.again == 0
    record(first, [], step)
    assert records.again == 1


def test_install_patches_the_tree_once(stand_ins, monkeypatch):
    monkeypatch.setattr(cuda_graph_records, "_PROCESS", None)
    check = NODE.check_invariants
    assert cuda_graph_records.recorded_again() is None  # (before install: not counted, not 0)
    assert cuda_graph_records.reasons_again() == []
    records = cuda_graph_records.install()
    assert cuda_graph_records.install() is records and cuda_graph_records.recorded_again() == 0
    assert NODE.check_invariants is check  # (the replays' hot path left alone: no reasons kept)
    tree, step = Tree(0), cudagraph_trees.FunctionID(0)
    MANAGER.record_function(tree, [], step)
    MANAGER.record_function(tree, [], step)
    assert cuda_graph_records.recorded_again() == 1  # (patched once: a second install did not wrap it twice)
    assert cuda_graph_records.reasons_again() == ["step0: no failed check"]
