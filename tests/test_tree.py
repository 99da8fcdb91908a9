"""Tree buffers, candidates, tree growth and drawings (tree.py)."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from tree import (build_tree_buffers, dense_tree, expected_tokens_per_step, gather_paths, generate_candidates,
                  grow_tree, plot_tree, plot_tree_mask)

DENSE_2x3 = [(0,), (1,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
SPARSE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def test_worked_example_dense_2x3():
    """The dense 2x3 tree gives the buffers worked out by hand in the issue."""
    b = build_tree_buffers(DENSE_2x3)
    assert b.node_paths == [()] + sorted(DENSE_2x3, key=lambda p: (len(p), p)), f"node order {b.node_paths}"
    assert b.position_ids.tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2], f"position ids {b.position_ids.tolist()}: the depths"
    rows = b.retrieve_indices.tolist()
    assert rows == [[0, 2, 8], [0, 2, 7], [0, 2, 6], [0, 1, 5], [0, 1, 4], [0, 1, 3]], \
        f"retrieve indices {rows}: one row per leaf, leaves from the last node to the first"
    node = {p: i for i, p in enumerate(b.node_paths)}
    for path, sees in [((0,), [(), (0,)]), ((1, 2), [(), (1,), (1, 2)])]:
        got = b.attn_mask[node[path]].nonzero().flatten().tolist()
        assert got == [node[p] for p in sees], (f"mask row of node {path} shows nodes "
                                                f"{[b.node_paths[j] for j in got]}, expected {sees}")
    assert set(dense_tree([2, 3])) == set(DENSE_2x3), f"dense_tree([2, 3]) = {dense_tree([2, 3])}"


@pytest.mark.parametrize("choices", [DENSE_2x3, SPARSE, [(0,), (0, 0), (0, 0, 0)]])
def test_buffers_follow_the_definitions(choices):
    """Node order, mask (prefix relation), depths, and one retrieve row per leaf with -1 padding."""
    b = build_tree_buffers(choices)
    paths = b.node_paths
    assert paths == [()] + sorted(choices, key=lambda p: (len(p), p)), f"node order {paths}"
    for i, p in enumerate(paths):
        for j, q in enumerate(paths):
            assert bool(b.attn_mask[i, j]) == (p[:len(q)] == q), \
                f"mask[{i}, {j}]: may node {p} see node {q}? {bool(b.attn_mask[i, j])}, expected {p[:len(q)] == q}"
        assert b.position_ids[i] == len(p), f"position id of node {p} is {int(b.position_ids[i])}, expected its depth"
    leaves = [p for p in paths if not any(q[:-1] == p for q in paths[1:])]
    shape = (len(leaves), max(map(len, paths)) + 1)
    assert b.retrieve_indices.shape == shape, f"retrieve indices {tuple(b.retrieve_indices.shape)}, expected {shape}"
    expected_order = sorted(leaves, key=lambda p: (len(p), p), reverse=True)
    for r, (row, n, leaf) in enumerate(zip(b.retrieve_indices.tolist(), b.path_lengths.tolist(), expected_order)):
        assert [paths[i] for i in row[:n]] == [leaf[:k] for k in range(len(leaf) + 1)], \
            f"row {r} is {row} (path_lengths {n}), expected the path of leaf {leaf}"
        assert all(i == -1 for i in row[n:]), f"row {r} is {row}: after its {n} real nodes, padding is -1"


@pytest.mark.parametrize("choices, message", [
    ([], "empty"),
    ([(0,), (1, 0)], "prefix-closed"),
    ([(0, 0, 0), (0,)], "prefix-closed"),
    ([(0,), (-1,)], "non-negative"),
    ([(0,), (0,)], "duplicate"),
    ([(), (0,)], "root"),
])
def test_bad_trees_raise_clear_errors(choices, message):
    """Trees that are empty, not prefix-closed, with a negative rank, duplicates or an explicit root."""
    with pytest.raises(ValueError, match=message):
        build_tree_buffers(choices)


def test_generate_candidates_reads_head_ranks(device):
    """Node (i1..ik) carries head k's rank-ik token; root is the argmax or the given token."""
    V = 10
    base = torch.zeros(V, device=device); base[7] = 5.0
    heads = torch.stack([torch.arange(V, dtype=torch.float),            # head 1 ranks: 9, 8, 7
                         -torch.arange(V, dtype=torch.float)]).to(device)  # head 2 ranks: 0, 1, 2
    b = build_tree_buffers(DENSE_2x3, device)
    tokens, candidates = generate_candidates(base, heads, b)
    expected = {(): 7, (0,): 9, (1,): 8, (0, 0): 0, (0, 1): 1, (0, 2): 2, (1, 0): 0, (1, 1): 1, (1, 2): 2}
    got = dict(zip(b.node_paths, tokens.tolist()))
    wrong = [p for p in b.node_paths if got[p] != expected[p]]
    assert not wrong, (f"node {wrong[0]} carries token {got[wrong[0]]}, expected {expected[wrong[0]]} (root: the base "
                       f"argmax 7; head 1 ranks 9, 8, 7; head 2 ranks 0, 1, 2)")
    assert candidates.tolist()[0] == [7, 8, 2], f"candidate row 0 {candidates.tolist()[0]}: the path root, (1,), (1, 2)"
    tokens, candidates = generate_candidates(base, heads, b, root=torch.tensor(4, device=device))
    assert tokens[0] == 4 and (candidates[:, 0] == 4).all(), f"root=4 given: tree tokens {tokens.tolist()}"
    _, candidates = generate_candidates(base, heads, build_tree_buffers([(0,), (1,), (0, 0)], device))
    assert candidates.tolist() == [[7, 9, 0], [7, 8, -1]], f"candidates {candidates.tolist()}: padding is -1"


def test_candidates_read_only_the_trees_heads_and_pad_short_rows(device):
    """With more heads than the tree is deep, only the first buffers.depth heads are read, and every
    slot past the end of a shorter row is -1 (a head past the tree's depth would put a token there)."""
    V, K = 16, 5
    base = torch.zeros(V, device=device); base[2] = 5.0  # the root: token 2
    # Head k (1-based) ranks its tokens 3k, 3k + 1, ... (mod V): head 5, past every tree here, says 15.
    heads = torch.stack([-((torch.arange(V) - 3 * k) % V).float() for k in range(1, K + 1)]).to(device)
    for choices, expected in [
        # SPARSE, 4 deep: rows end at (0,0,0,0), (0,0,1), (1,0), (0,1) and (2,)
        (SPARSE, [[2, 3, 6, 9, 12], [2, 3, 6, 10, -1], [2, 4, 6, -1, -1], [2, 3, 7, -1, -1], [2, 5, -1, -1, -1]]),
        ([(0,), (1,), (0, 0)], [[2, 3, 6], [2, 4, -1]]),  # 2 deep, 5 heads
    ]:
        b = build_tree_buffers(choices, device)
        _, candidates = generate_candidates(base, heads, b)
        got = candidates.tolist()
        assert got == expected, (f"{K} heads, a {b.depth}-deep tree: candidates {got}, expected {expected} (head "
                                 f"k's rank r is token 3k + r; only heads 1..{b.depth} are read; -1 past a row's end)")


def test_gather_paths_lays_node_values_along_rows():
    """Row r, slot j holds the value of node retrieve_indices[r, j]; a padded slot reads the root's."""
    b = build_tree_buffers([(0,), (1,), (0, 0)])  # rows: root,(0),(0,0) and root,(1),pad
    values = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # (N, 1): node n holds 10 + n
    got = gather_paths(values, b)
    assert got.shape == (2, 3, 1), f"shape {tuple(got.shape)}, expected (P, L, 1) = (2, 3, 1)"
    assert got[..., 0].tolist() == [[10, 11, 13], [10, 12, 10]], \
        f"rows {got[..., 0].tolist()}, expected [[10, 11, 13], [10, 12, 10]]: the padded slot reads the root (10)"


def test_dense_tree_node_count():
    """A dense tree has sum_k prod_{i<=k} s_i nodes."""
    assert len(dense_tree([3, 2, 2])) == 3 + 6 + 12
    assert dense_tree([1, 1, 1]) == [(0,), (0, 0), (0, 0, 0)]


def test_grow_tree_on_a_hand_made_table():
    """Greedy growth adds the most probable frontier node each time; expectation is 1 + sum of products."""
    acc = [[0.6, 0.2], [0.5, 0.1]]
    tree = grow_tree(acc, 4)
    assert tree == [(0,), (0, 0), (1,), (1, 0)], \
        f"grow_tree(acc, 4) = {tree}, expected [(0,), (0, 0), (1,), (1, 0)]: path products 0.6, 0.3, 0.2, 0.1"
    got = expected_tokens_per_step(tree, acc)
    assert got == pytest.approx(1 + 0.6 + 0.3 + 0.2 + 0.1), f"expected tokens per step {got}, expected 2.2 = 1 (root) + 1.2"
    tail = grow_tree(acc, 6)[-2:]
    assert tail == [(0, 1), (1, 1)], f"nodes 5 and 6 of grow_tree(acc, 6) are {tail}, expected (0, 1) (0.06), then (1, 1) (0.02)"
    # Ties go to the first node in node order: (1,) (shorter) before (0, 0).
    tie = grow_tree([[0.5, 0.5], [1.0, 0.0]], 2)
    assert tie == [(0,), (1,)], f"(1,) and (0, 0) both have probability 0.5: got {tie}, expected the shorter (1,) second"
    with pytest.raises(ValueError, match="supplies"):
        grow_tree(acc, 7)
    with pytest.raises(ValueError, match="more heads or ranks"):
        expected_tokens_per_step([(0,), (0, 0), (0, 0, 0)], acc)


def dense_shapes(max_nodes, max_depth, max_width):
    """Every widths list whose dense tree has at most max_nodes nodes."""
    def extend(widths, nodes, level):
        if widths:
            yield list(widths)
        if len(widths) == max_depth:
            return
        for w in range(1, max_width + 1):
            new_level = level * w
            if nodes + new_level > max_nodes:
                break
            yield from extend(widths + [w], nodes + new_level, new_level)
    yield from extend([], 0, 1)


REALISTIC = [[0.60, 0.10, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01],  # head 1, ranks 0..7
             [0.45, 0.10, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01],
             [0.35, 0.09, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01],
             [0.30, 0.08, 0.04, 0.03, 0.02, 0.01, 0.01, 0.01],
             [0.25, 0.07, 0.04, 0.03, 0.02, 0.01, 0.01, 0.01]]


@pytest.mark.parametrize("n", [4, 10, 20, 40, 64])
def test_grown_tree_beats_every_dense_tree_of_at_most_n_nodes(n):
    """Paper section 2.3.3: the greedy sparse tree is at least as good as any dense tree of its size."""
    grown = expected_tokens_per_step(grow_tree(REALISTIC, n), REALISTIC)
    shapes = list(dense_shapes(n, 5, 8))
    assert len(shapes) > 5, f"the test's own setup: only {len(shapes)} dense shapes"
    for widths in shapes:
        dense = expected_tokens_per_step(dense_tree(widths), REALISTIC)
        assert grown >= dense - 1e-12, f"grown tree of {n} nodes: {grown:.4f} tokens/step < dense {widths}: {dense:.4f}"


def test_plots_have_titles_and_labels():
    """The two drawings students look at render with a title and labelled axes."""
    b = build_tree_buffers(SPARSE)
    ax = plot_tree_mask(b)
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), "the mask plot needs a title and axis labels"
    ax = plot_tree(SPARSE, highlight=(0, 0, 1))
    assert "(0, 0, 1)" in ax.get_title() and ax.get_xlabel(), \
        f"the tree plot's title {ax.get_title()!r} must name the highlighted path (0, 0, 1); and an x label"
    ax.figure.canvas.draw()
