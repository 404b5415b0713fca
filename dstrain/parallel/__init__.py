"""Applying parallelism to the single-device model: meshes, TP, EP, AC, compile, FSDP/DDP, PP."""
