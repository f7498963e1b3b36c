"""Generation backends behind the RolloutWorker interface (vLLM)."""
