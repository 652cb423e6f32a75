"""The benchmark scripts; installed as `trace_mega.benchmarks` (see setup.py) so that
`trace-mega bench NAME` finds `bench_NAME.py` without the checkout."""
