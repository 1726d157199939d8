"""Index builders against small hand-written cases."""
import numpy as np
import pytest

from jax_dsa import indices


def test_sliding_window():
    np.testing.assert_array_equal(indices.sliding_window(4, 3), [
        [-1, -1, 0], [-1, 0, 1], [0, 1, 2], [1, 2, 3]])
    np.testing.assert_array_equal(indices.sliding_window(2, 2, start=5), [[4, 5], [5, 6]])
    with pytest.raises(ValueError, match="window"):
        indices.sliding_window(4, 0)


def test_compressed_causal():
    # ratio 2, 6 tokens: rows 0 (tokens 0-1), 1 (2-3), 2 (4-5); row j complete at t = 2j + 1.
    np.testing.assert_array_equal(indices.compressed_causal(6, 2), [
        [-1, -1, -1], [0, -1, -1], [0, -1, -1], [0, 1, -1], [0, 1, -1], [0, 1, 2]])
    assert indices.compressed_causal(3, 4).shape == (3, 0)


def test_causal_topk():
    scores = np.array([[5., 1., 9., 2.],
                       [5., 1., 9., 2.],
                       [5., 1., 9., 2.],
                       [5., 7., 9., 2.]], np.float32)  # ratio 1: row j visible from t = j
    np.testing.assert_array_equal(indices.causal_topk(scores, 2, 1), [
        [0, -1], [0, 1], [2, 0], [2, 1]])
    # k larger than the number of rows pads with -1; batch dims broadcast.
    got = indices.causal_topk(np.stack([scores, -scores]), 5, 1)
    np.testing.assert_array_equal(got[1], [[0, -1, -1, -1, -1], [1, 0, -1, -1, -1],
                                           [1, 0, 2, -1, -1], [3, 0, 1, 2, -1]])
    with pytest.raises(ValueError, match="compressed rows"):
        indices.causal_topk(scores, 2, 2)


def test_concat_window_compressed():
    w = indices.sliding_window(3, 2)
    c = indices.compressed_causal(3, 1)
    np.testing.assert_array_equal(indices.concat_window_compressed(w, c, offset=3), [
        [-1, 0, 3, -1, -1], [0, 1, 3, 4, -1], [1, 2, 3, 4, 5]])


def test_causal_topk_keeps_visible_rows_scoring_minus_inf_and_ranks_in_float64():
    import jax
    scores = np.zeros((1, 4), np.float32)
    scores[0, 1] = -np.inf  # visible (start 3: all four rows), so it takes the last slot
    np.testing.assert_array_equal(indices.causal_topk(scores, 5, 1, start=3), [[0, 2, 3, 1, -1]])
    with jax.enable_x64(True):
        close = np.array([[1.0, 1.0 + 1e-12]])  # equal in float32
        np.testing.assert_array_equal(indices.causal_topk(close, 1, 1, start=1), [[1]])


@pytest.mark.parametrize("call,error", [
    (lambda: indices.sliding_window(2, 2.0), TypeError),
    (lambda: indices.sliding_window(2, 2, start=1.5), TypeError),
    (lambda: indices.sliding_window(2, True), TypeError),
    (lambda: indices.compressed_causal(4, 2, start=-1), ValueError),
    (lambda: indices.causal_topk(np.zeros((2, 2)), 1.0, 1), TypeError),
    (lambda: indices.concat_window_compressed(np.zeros((1, 2), np.int32),
                                              np.zeros((1, 2), np.int32), -3), ValueError),
])
def test_builders_take_python_ints(call, error):
    with pytest.raises(error):
        call()
