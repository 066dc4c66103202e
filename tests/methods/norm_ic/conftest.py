"""Norm-IC tests run single-threaded (tests/conftest.py): one thread measured 7x faster than two for MiniLM
extraction on the shared 2-core machine (benchmarks/bench_normic.py)."""
