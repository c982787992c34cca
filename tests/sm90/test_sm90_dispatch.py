"""The configuration "auto" picks for a row count (CPU: the rule only; the bytes are the same for every configuration,
which tests/sm90/test_sm90.py checks on the GPU)."""
import pytest

from fused_logp.kernel import sm90


@pytest.mark.parametrize("n_rows, launch", [
    (1, "cta-64x256"), (64, "cta-64x256"),            # one 64-row tile holds the batch
    (65, "cta-128x256"), (128, "cta-128x256"),        # two 64-row tiles: one full 128-row tile
    (129, "cta-64x256"), (192, "cta-64x256"),         # three: the 128-row grid's last tile would be half empty
    (193, "cta-128x256"), (256, "cta-128x256"),
    (257, "cta-64x256"), (320, "cta-64x256"),
    (321, "cta-128x256"), (448, "cta-128x256"), (576, "cta-128x256"), (8192, "cta-128x256"),
])
def test_auto_launch_by_row_count(n_rows, launch):
    assert sm90.auto_launch(n_rows) == launch


def test_auto_launch_names_a_built_configuration():
    assert {sm90.auto_launch(n) for n in range(1, 1025)} <= set(sm90.LAUNCHES)
