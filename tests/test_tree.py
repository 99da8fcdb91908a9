"""Tree buffers, candidates, tree growth and drawings (tree.py)."""
import itertools

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
    assert len(b.node_paths) == 9 and b.node_paths[0] == ()
    assert b.position_ids.tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2]
    assert b.retrieve_indices.tolist() == [[0, 2, 8], [0, 2, 7], [0, 2, 6], [0, 1, 5], [0, 1, 4], [0, 1, 3]]
    node = {p: i for i, p in enumerate(b.node_paths)}
    assert b.attn_mask[node[(0,)]].nonzero().flatten().tolist() == [0, node[(0,)]]
    assert b.attn_mask[node[(1, 2)]].nonzero().flatten().tolist() == [0, node[(1,)], node[(1, 2)]]
    assert set(dense_tree([2, 3])) == set(DENSE_2x3)


@pytest.mark.parametrize("choices", [DENSE_2x3, SPARSE, [(0,), (0, 0), (0, 0, 0)]])
def test_buffers_follow_the_definitions(choices):
    """Node order, mask (prefix relation), depths, and one retrieve row per leaf with -1 padding."""
    b = build_tree_buffers(choices)
    paths = b.node_paths
    assert paths[1:] == sorted(paths[1:], key=lambda p: (len(p), p))
    for i, p in enumerate(paths):
        for j, q in enumerate(paths):
            assert bool(b.attn_mask[i, j]) == (p[:len(q)] == q)
        assert b.position_ids[i] == len(p)
    leaves = [p for p in paths if not any(q[:-1] == p for q in paths[1:])]
    assert b.retrieve_indices.shape == (len(leaves), max(map(len, paths)) + 1)
    expected_order = sorted(leaves, key=lambda p: (len(p), p), reverse=True)
    for row, n, leaf in zip(b.retrieve_indices.tolist(), b.path_lengths.tolist(), expected_order):
        assert [paths[i] for i in row[:n]] == [leaf[:k] for k in range(len(leaf) + 1)]
        assert all(i == -1 for i in row[n:])


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
    assert tokens.tolist() == [expected[p] for p in b.node_paths]
    assert candidates.tolist()[0] == [7, 8, 2]  # row 0 is the path root, (1), (1, 2)
    tokens, candidates = generate_candidates(base, heads, b, root=torch.tensor(4, device=device))
    assert tokens[0] == 4 and (candidates[:, 0] == 4).all()
    _, candidates = generate_candidates(base, heads, build_tree_buffers([(0,), (1,), (0, 0)], device))
    assert candidates.tolist() == [[7, 9, 0], [7, 8, -1]]  # padding is -1, never a token


def test_gather_paths_lays_node_values_along_rows():
    """Row r, slot j holds the value of node retrieve_indices[r, j]; a padded slot reads the root's."""
    b = build_tree_buffers([(0,), (1,), (0, 0)])  # rows: root,(0),(0,0) and root,(1),pad
    values = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # (N, 1): node n holds 10 + n
    assert gather_paths(values, b)[..., 0].tolist() == [[10, 11, 13], [10, 12, 10]]


def test_dense_tree_node_count():
    """A dense tree has sum_k prod_{i<=k} s_i nodes."""
    assert len(dense_tree([3, 2, 2])) == 3 + 6 + 12
    assert dense_tree([1, 1, 1]) == [(0,), (0, 0), (0, 0, 0)]


def test_grow_tree_on_a_hand_made_table():
    """Greedy growth adds the most probable frontier node each time; expectation is 1 + sum of products."""
    acc = [[0.6, 0.2], [0.5, 0.1]]
    tree = grow_tree(acc, 4)
    assert tree == [(0,), (0, 0), (1,), (1, 0)]  # products 0.6, 0.3, 0.2, 0.1
    assert expected_tokens_per_step(tree, acc) == pytest.approx(1 + 0.6 + 0.3 + 0.2 + 0.1)
    assert grow_tree(acc, 6)[-2:] == [(0, 1), (1, 1)]  # 0.06, then 0.02
    # Ties go to the first node in node order: (1,) (shorter) before (0, 0).
    assert grow_tree([[0.5, 0.5], [1.0, 0.0]], 2) == [(0,), (1,)]
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
    assert len(shapes) > 5
    for widths in shapes:
        assert grown >= expected_tokens_per_step(dense_tree(widths), REALISTIC) - 1e-12, widths


def test_plots_have_titles_and_labels():
    """The two drawings students look at render with a title and labelled axes."""
    b = build_tree_buffers(SPARSE)
    ax = plot_tree_mask(b)
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    ax = plot_tree(SPARSE, highlight=(0, 0, 1))
    assert "(0, 0, 1)" in ax.get_title() and ax.get_xlabel()
    ax.figure.canvas.draw()
