"""GPU target descriptions (XLA `GpuTargetConfig` text protos) for compiling without a GPU (`meshtrain.aot`)."""
