"""Block-FP8 GEMM backends (`base`, `emulated`, `gpu` with the cuBLASLt op in `cublas`) and their
selection (`registry`)."""
