"""The position/segment attention mask, including packed groups behind a shared prefix."""

import jax.numpy as jnp
import numpy as np

from tunix_rt.models.attention import attention_mask


def test_segments_and_shared_prefix():
    # prompt (2 tokens, segment -1) | completion 1 (2 tokens) | completion 2 (1 token) | padding
    positions = jnp.array([[0, 1, 2, 3, 2, -1]])
    segments = jnp.array([[-1, -1, 1, 1, 2, 0]])
    mask = np.asarray(attention_mask(positions, positions, None, segments))[0].astype(int)
    np.testing.assert_array_equal(mask, [
        [1, 0, 0, 0, 0, 0],  # the prompt sees itself, causally
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # completion 1 sees the prompt and itself
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # completion 2 sees the prompt and itself, never completion 1
        [0, 0, 0, 0, 0, 0],  # padding sees nothing
    ])


def test_positive_segments_stay_apart():
    positions = jnp.array([[0, 1, 0, 1]])
    segments = jnp.array([[1, 1, 2, 2]])
    mask = np.asarray(attention_mask(positions, positions, None, segments))[0].astype(int)
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
