"""The configuration "auto" picks for a row count (CPU: the rule only; the bytes are the same for every configuration,
which tests/sm90/test_sm90.py checks on the GPU)."""
import pytest

from fused_logp.kernel import sm90


@pytest.mark.parametrize("n_rows, launch", [
    (1, "cta-64x256"), (64, "cta-64x256"),            # one 64-row tile holds the batch
    (65, "pingpong-128x192"), (128, "pingpong-128x192"),
    (129, "swapab-128"), (160, "swapab-128"), (192, "swapab-128"),     # three 64-row tiles: the 128-row grid's last
    (257, "swapab-128"), (320, "swapab-128"),                          # tile would be half empty (five: likewise)
    (193, "pingpong-128x192"), (256, "pingpong-128x192"), (321, "pingpong-128x192"), (2048, "pingpong-128x192"),
    (4096, "pingpong-128x192"),
    (4097, "cta-128x256"), (8192, "cta-128x256"), (16384, "cta-128x256"),
])
def test_auto_launch_by_row_count(n_rows, launch):
    assert sm90.auto_launch(n_rows, 4096, 151936) == launch


@pytest.mark.parametrize("n_rows, launch", [
    (1, "cta-64x256"), (64, "cta-64x256"),            # one 64-row tile holds the batch
    (65, "cta-128x256"), (128, "cta-128x256"),        # two 64-row tiles: one full 128-row tile
    (129, "cta-64x256"), (192, "cta-64x256"),         # three: the 128-row grid's last tile would be half empty
    (193, "cta-128x256"), (256, "cta-128x256"),
    (257, "cta-64x256"), (320, "cta-64x256"),
    (321, "cta-128x256"), (448, "cta-128x256"), (576, "cta-128x256"), (8192, "cta-128x256"),
])
@pytest.mark.parametrize("d, width", [(4000, 151936), (4096, 151935)])
def test_auto_launch_where_the_pingpong_kernel_does_not_take_the_shape(n_rows, launch, d, width):
    """D or the width not a multiple of 64: the CTA configurations by row count."""
    assert sm90.auto_launch(n_rows, d, width) == launch


def test_auto_launch_names_a_built_configuration():
    assert {sm90.auto_launch(n, d, w) for n in range(1, 9000, 3) for d, w in [(4096, 151936), (4000, 151935)]} \
        <= set(sm90.LAUNCHES) - sm90.CANDIDATE_LAUNCHES


def test_auto_picks_a_limited_configuration_only_where_it_takes_the_shape():
    for d, w in [(4000, 151936), (4096, 151935), (80, 640), (4096, 100)]:
        assert not {sm90.auto_launch(n, d, w) for n in range(1, 9000, 7)} & sm90._MULTIPLE_OF_64
    assert sm90._MULTIPLE_OF_64 <= set(sm90.LAUNCHES)


def test_a_candidate_configuration_is_refused_unless_allowed(monkeypatch):
    """The mechanism for a configuration that is built but not kept (pingpong-128x192-dyn and pingpong-128x192-mc2
    at present): a name in CANDIDATE_LAUNCHES is refused unless FUSED_LOGP_CANDIDATE_LAUNCHES=1."""
    monkeypatch.setattr(sm90, "CANDIDATE_LAUNCHES", frozenset({"cta-64x128"}))
    monkeypatch.delenv("FUSED_LOGP_CANDIDATE_LAUNCHES", raising=False)
    be = sm90.SM90Backend()
    be.launch = "cta-64x128"
    with pytest.raises(ValueError, match="'cta-64x128' has not passed the GPU test suite yet; set "
                                         "FUSED_LOGP_CANDIDATE_LAUNCHES=1"):
        be._launch_name(256, 4096, 151936)
    monkeypatch.setenv("FUSED_LOGP_CANDIDATE_LAUNCHES", "1")
    assert sm90.SM90Backend().allow_candidates
    be.allow_candidates = True
    assert be._launch_name(256, 4096, 151936) == "cta-64x128"


@pytest.mark.parametrize("d, width", [(4000, 151936), (4096, 151935), (4000, 1000)])
def test_what_the_pingpong_configuration_does_not_take_is_refused(d, width):
    be = sm90.SM90Backend()
    be.launch = "pingpong-128x192"
    with pytest.raises(ValueError, match=rf"'pingpong-128x192' takes D and the vocabulary width in multiples of 64, "
                                         rf"got D = {d} and width {width}; use 'auto' or one of \['cta-128x256', "
                                         rf"'cta-64x256', 'cta-64x128'\]"):
        be._launch_name(256, d, width)
    be.launch = "auto"
    assert be._launch_name(256, d, width) == "cta-128x256"


def test_dz_auto_launch_names_a_built_configuration_that_takes_the_shape():
    for d in (16, 1000, 4000, 4096, 8192):
        name = sm90.dz_auto_launch(d)
        assert name in set(sm90.DZ_LAUNCHES) - sm90.DZ_CANDIDATE_LAUNCHES
        assert name != "pingpong-128x192" or d % 64 == 0


def test_the_dz_launch_is_checked_before_the_extension(monkeypatch):
    """backward_dz's configuration (SM90Backend.dz_launch): an unknown name, a candidate without
    FUSED_LOGP_CANDIDATE_LAUNCHES=1 and the ping-pong kernel at D % 64 != 0 are refused with the accepted values."""
    monkeypatch.delenv("FUSED_LOGP_CANDIDATE_LAUNCHES", raising=False)
    be = sm90.SM90Backend()
    assert be._dz_launch_name(4096) == "cta-128x256" and be._dz_launch_name(4000) == "cta-128x256"
    be.dz_launch = "pingpong-64x256"
    with pytest.raises(ValueError, match=r"dz_launch must be 'auto' or one of \['cta-128x256', 'pingpong-128x192', "
                                         r"'pingpong-128x192-dyn'\], "
                                         r"got 'pingpong-64x256'"):
        be._dz_launch_name(4096)
    be.dz_launch = "pingpong-128x192"
    assert "pingpong-128x192" in sm90.DZ_CANDIDATE_LAUNCHES
    with pytest.raises(ValueError, match="dz_launch 'pingpong-128x192' has not passed the GPU test suite yet; set "
                                         "FUSED_LOGP_CANDIDATE_LAUNCHES=1"):
        be._dz_launch_name(4096)
    be.allow_candidates = True
    assert be._dz_launch_name(4096) == "pingpong-128x192"
    with pytest.raises(ValueError, match="dz_launch 'pingpong-128x192' takes D a multiple of 64, got D = 4000; use "
                                         "'auto' or 'cta-128x256'"):
        be._dz_launch_name(4000)
    be.dz_launch = "cta-128x256"
    assert be._dz_launch_name(4000) == "cta-128x256"


def test_dz_launch_names_are_the_extension_source():
    """The extension's dz_launch_names() (sm90_backward.cu) lists sm90.DZ_LAUNCHES, and its backward_dz checks the
    same names (the GPU suite compares the built extension's list too)."""
    import re
    from pathlib import Path
    src = (Path(sm90.__file__).parent / "csrc" / "sm90_backward.cu").read_text()
    listed = re.search(r"dz_launch_names\(\) \{ return \{([^}]*)\}; \}", src).group(1)
    assert [n.strip().strip('"') for n in listed.split(",")] == list(sm90.DZ_LAUNCHES)
    for name in sm90.DZ_LAUNCHES:
        assert f'launch == "{name}"' in src
