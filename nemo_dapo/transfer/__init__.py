"""Weight transfer from the training ranks to the vLLM engines over a collective (docs/architecture.md, Weight sync)."""
