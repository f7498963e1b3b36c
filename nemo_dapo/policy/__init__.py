"""Training backends behind the PolicyWorker interface: ``torch_worker`` (Hugging Face model, DDP)
and ``megatron/`` (megatron-core); what they are fed (``inputs``) and their shared loss."""
