"""The budget curve of the demo's protocol, measured by `python benchmarks/quality.py --curve` (benchmarks/RESULTS.md):
per claim and budget, every curve seed's difference, the rule's verdict and the seeds that agree. The report of
`hf-ppmoe demo` quotes it when its setting is the one measured (tests/benchmarks/test_quality.py checks that this
copy equals `curve_summary` of benchmarks/results/quality_curve.json)."""

CURVE = None  # not measured yet for this protocol


def curve_for(setting) -> dict | None:
    """The budget curve measured for `setting` (all fields but the budget and seeds equal), else None."""
    return CURVE if CURVE is not None and CURVE["setting"] == setting.compatible() else None
