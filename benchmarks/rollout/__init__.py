"""Pieces of the rollout-throughput benchmark (`benchmarks/rollout_throughput.py`): the models and
their checkpoints, one engine process per variant, and the report."""
