"""The agreement statistics and the report writer."""
import numpy as np

from fused_logp_jobs.report import compare, plot_drift, write_report


def test_compare_exact_and_drift():
    a = np.array([-1.0, -2.5, -0.125], dtype=np.float32)
    exact = compare(a, a.copy())
    assert exact["mismatches"] == 0 and exact["max_abs_delta"] == 0 and exact["k3_max"] == 0
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(0))
    drift = compare(a, b)
    assert drift["mismatches"] == 1 and drift["max_abs_delta"] > 0 and drift["k3_max"] > 0
    neg_zero = compare(np.array([0.0], np.float32), np.array([-0.0], np.float32))
    assert neg_zero["mismatches"] == 1                  # bytes, not values


def test_report_and_plots(tmp_path):
    rng = np.random.default_rng(0)
    a = -rng.random(40).astype(np.float32)
    series = {"contract": (a, a.copy()), "ordinary": (a, (a + rng.normal(0, 1e-3, 40)).astype(np.float32))}
    plots = plot_drift(tmp_path, series, np.tile(np.arange(8), 5))
    assert all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in plots)
    md, js = write_report(tmp_path, "t", {k: compare(*v) for k, v in series.items()}, {"x": {"y": 1}}, plots)
    assert "drift_cdf.png" in open(md).read()
