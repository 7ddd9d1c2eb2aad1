"""Block-FP8 GEMM backends (`base`, `emulated`, `gpu`) and their selection (`registry`)."""
