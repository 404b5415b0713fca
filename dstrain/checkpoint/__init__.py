"""Checkpoints: sharded DCP saves of the whole training state, and finding them again."""
