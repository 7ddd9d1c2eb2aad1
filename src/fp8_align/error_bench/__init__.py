"""The token-probability-error benchmark (`fp8-align bench-error`, `error.run_bench_error`): its
default model (`default_model`), prompts, the vLLM generation runner it and the tests use
(`generate`), teacher-forced scoring, the Megatron training side and the report.

Not to be confused with the repository's `benchmarks/` folder (GPU scripts, not shipped).
"""
