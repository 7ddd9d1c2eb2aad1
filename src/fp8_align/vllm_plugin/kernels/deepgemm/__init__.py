"""DeepGEMM's JIT cache around the `deepgemm` GEMM backend (`kernels.gpu`): which kernels an engine
needs and whether a cache holds them (`inventory`), `fp8-align prepare-deepgemm` filling it ahead in
parallel processes (`cache`), a cold cache filled at engine start (`fill`), and the engine's
warm-up of each layer shape (`warmup`)."""
