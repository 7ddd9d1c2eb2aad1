"""Benchmarks and the vLLM generation runner they (and the tests) use."""
