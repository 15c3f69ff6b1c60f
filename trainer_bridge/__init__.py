"""Splice's trainer side: pull token-exact samples from Splice proxies over HTTP and learn from them.

Modules, one job each:

- ``client``       -- HTTP client for pull/ack and the weight-update protocol (the only link to the proxy)
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

from .advantages import group_advantages
from .client import ProxyClient, ProxyError
from .logprobs import token_logprobs, token_logprobs_and_entropy
from .loss import decoupled_ppo_loss

__all__ = [
    "ProxyClient",
    "ProxyError",
    "decoupled_ppo_loss",
    "group_advantages",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
