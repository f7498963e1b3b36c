"""The megatron-core training backend: TP, PP, CP, EP, the distributed optimizer, sharded checkpoints.

``worker.py`` is the PolicyWorker; ``model.py`` builds the GPT model and its options,
``convert.py`` / ``export.py`` map Hugging Face weights in and out, ``cpu_compat.py`` holds
the patches that let megatron-core run over gloo on a CPU.
"""
