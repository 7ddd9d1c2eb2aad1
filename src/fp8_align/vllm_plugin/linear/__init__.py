"""Linear layers of an fp8_align engine: the block-FP8 method, the BF16 method, shard layout."""
