"""FP8 KV cache scales: read and push them (`scales`), calibrate them on a batch (`calibration`)."""
