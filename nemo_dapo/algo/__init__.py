"""The pure tensor math of DAPO: no Ray, no vLLM, no Megatron, no I/O."""

from nemo_dapo.algo import advantage, batch, correction, kl, logprob, loss, metrics, sampling, shaping

__all__ = ["advantage", "batch", "correction", "kl", "logprob", "loss", "metrics", "sampling", "shaping"]
