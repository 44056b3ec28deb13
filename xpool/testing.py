"""Moved: the C hooks tests and benchmarks use (cfunctions, pool_with_stream_lookup) left the shipped package."""
raise ImportError("xpool.testing moved to the tests' fixture package: `pip install -e tests/xpool/fixtures/twin` "
                  "from a checkout of xpool, then `import xpool_twin.testing`")
