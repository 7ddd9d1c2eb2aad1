"""Linear layers of an fp8_align engine: the block-FP8 method and its re-quantizing loader, the BF16 method."""
