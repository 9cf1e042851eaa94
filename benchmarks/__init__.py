"""asv suites for cachegen (see docs/benchmarks.md); pytest-benchmark micro-benchmarks live in
micro/."""
