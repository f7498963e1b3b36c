"""Training loops, checkpointing, metric tracking."""
