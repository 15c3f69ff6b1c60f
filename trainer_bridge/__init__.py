"""Splice's trainer side: pull token-exact samples from Splice proxies over HTTP and learn from them.

Modules, one job each:

- ``client``       -- HTTP client for pull/ack and the weight-update protocol (the only link to the proxy)
- ``publish``      -- the fleet weight-update protocol (``splice publish``), torch-free
- ``advantages``   -- GRPO advantages, normalized over each group's sessions
- ``batching``     -- right-padded micro-batches under a token budget, every per-token array in step
- ``logprobs``     -- chunked log-probs/entropy from hidden states, in token coordinates
- ``loss``         -- decoupled PPO loss with the segment-wise behaviour weight
- ``policy``       -- a transformers causal LM whose forward returns log-probs; save as an HF directory
- ``stats``        -- merging per-micro-batch stats into per-step stats
- ``distributed``  -- torchrun/DDP plumbing (rank 0 pulls and publishes)
- ``config``/``train`` -- the trainer loop and the ``splice train`` command line

It never imports ``proxy``, ``engines`` or ``tokenization``.
"""

from .client import ProxyClient, ProxyError

# The torch-backed parts load on first use, so ``splice publish`` (client + publish only) runs
# where torch is not installed, e.g. in the sidecar image.
_LAZY = {
    "group_advantages": "advantages",
    "token_logprobs": "logprobs",
    "token_logprobs_and_entropy": "logprobs",
    "decoupled_ppo_loss": "loss",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ProxyClient",
    "ProxyError",
    "decoupled_ppo_loss",
    "group_advantages",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
