"""One pure function per strategy, `apply_*(model, mesh, cfg)`, applied by the engine in a fixed order:
pipeline split -> tensor/sequence parallel -> context parallel -> activation checkpointing -> compile ->
FSDP or DDP."""
