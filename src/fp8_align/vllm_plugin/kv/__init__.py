"""FP8 KV cache scales: read and push them (`scales`), calibrate them on a batch (`calibration`,
observing attention through `probe`); XQA decode over the FP8 cache (`xqa_decode`); pushed
scales read live by vLLM 0.25's FLASHINFER decode (`flashinfer_scales`)."""
