"""Training backends behind the PolicyWorker interface (torch now; megatron later)."""
