"""The stiff benchmark's report: its time goal reads the NUTS seconds of each row's run."""


def _row(method, error, seconds, **extra):
    return dict(
        model="m",
        method=method,
        precondition=True,
        status="ok",
        mean_error_max=error,
        energy_distance=0.0,
        floor_ratio=error / 0.1,
        iid_floor_ratio=error / 0.1,
        fit_seconds=seconds,
        **extra,
    )


def test_time_ratio_divides_by_the_nuts_seconds_of_the_rows_own_run(load_benchmark):
    report = load_benchmark("stiff_report")
    # the best fit comes from a run that timed NUTS itself (200 s); the quickest one
    # within 3x the floor from a run that did not, so the reference's stored 100 s
    record = {
        "references": {"m": {"wall_time": 100.0}},
        "results": [
            _row("wsvgd", 0.2, 30.0, nuts_wall_time_this_run=200.0),
            _row("sivi", 0.25, 25.0),
        ],
    }
    line = next(line for line in report.goals(record) if line.startswith("| m |"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[1] == "wsvgd" and cells[5] == "0.15"  # 30 s / 200 s, not / 100 s
    assert cells[6] == "sivi" and cells[7] == "0.25"  # 25 s / 100 s
