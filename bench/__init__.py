"""Benchmarks, not shipped in the distribution: ``python -m bench.engine``,
``python -m bench.trainer``. Every figure is a ratio against peers measured in the same run."""
