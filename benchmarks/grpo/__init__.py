"""Pieces of the GRPO alignment benchmark (`benchmarks/grpo_alignment.py`): task, policy, engine, report."""
