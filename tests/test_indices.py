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
