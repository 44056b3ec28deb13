"""The lab's benchmark of debug mode's cost (xlab.bench.debug_cost): its rows and their provenance."""


def test_debug_cost_benchmark_writes_rows_with_provenance(tmp_path):
    from xlab.bench import debug_cost
    out = tmp_path / "cost.csv"
    df = debug_cost.run(sizes=(4096,), pairs=20, repeats=1, out=str(out))
    assert out.is_file() and set(df.debug) == {"off", "raise"}
    assert {"gpu", "commit", "date"} <= set(df.columns)
    assert df.set_index("debug").loc["raise", "ratio_vs_off"] > 1    # poisoning and canaries are not free
