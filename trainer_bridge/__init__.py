"""Splice's trainer side: pull token-exact samples from Splice proxies over HTTP and learn from them.

Modules, one job each:

- ``client``       -- HTTP client for pull/ack and the weight-update protocol (the only link to the proxy)
- ``errors``       -- ``ProxyError``, below the client and the protocol that raise it
- ``fleet``        -- the fleet protocol's shared pieces: report, error, load plan, the steps as client calls
- ``publish``      -- the fleet weight-update protocol (``splice publish``), torch-free
- ``weight_transfer`` -- weights broadcast over torch.distributed (``publish_tensors``, ``TrainerPublisher``)
- ``advantages``   -- GRPO advantages, normalized over each group's sessions
- ``batching``     -- packed (or padded) micro-batches under a token budget, every per-token array in step
- ``balance``      -- minibatches cut by tokens, samples spread over ranks by cost
- ``plan``         -- rank 0's plan of a step: each rank's share, micro-batches, normalisers
- ``logprobs``     -- chunked log-probs/entropy from hidden states, in token coordinates
- ``loss``         -- decoupled PPO loss with the segment-wise behaviour weight and its options
- ``policy``       -- a transformers causal LM whose forward returns log-probs; save as an HF directory
- ``sharding``     -- FSDP2 over decoder layers (and vision blocks) and the root; per-rank state bytes
- ``vision``       -- a Qwen2.5-VL policy's image inputs: span and grid checks, pixels per hash, M-RoPE positions
- ``image_fetch``  -- rank 0 fetches each image of a batch once (``GET /v1/images/{hash}``) and attaches it
- ``learner``      -- the sharded model + AdamW, and one training step on it
- ``checkpoint``   -- sharded training checkpoints (torch.distributed.checkpoint) and resume
- ``stats``        -- merging per-micro-batch stats into per-step stats
- ``distributed``  -- torchrun plumbing (rank 0 pulls, plans and publishes; each rank gets its share)
- ``samples``      -- a step's sample preparation: validation, staleness / missing-proximal masks, advantages, images
- ``step_publish`` -- a step's publish: the weights out (directory or broadcast), leases acked
- ``config``/``train`` -- the trainer loop and the ``splice train`` command line
- ``bench``        -- the worker of ``splice bench train``

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
