"""Splice's engine layer: token-in / token-out clients for SGLang and vLLM, and the pool.

- ``engines.pool.EnginePool`` is the only object the proxy needs: routing (consistent hashing
  of the session id over the replicas, failover along the ring), the policy version, the
  abort-resume loop (R1) and prefill-only logprobs (R2), pause / resume / weight updates, and
  the engines' own facts (``pool.info``: context length, model, weight version, control
  endpoints; ``pool.max_new_tokens`` keeps every turn's recompute prefill inside the context).
  Its jobs live in ``engines.pool_routing``, ``engines.pool_generate``, ``engines.pool_weights``
  and ``engines.pool_transfer`` (one mixin each); ``engines.replica`` is what it knows per replica.
- ``engines.sglang`` / ``engines.vllm`` speak each engine's wire format exactly (docs/design.md section
  9; vLLM's bodies and reply parsing in ``engines.vllm_wire``); ``engines.resume`` stitches abort-resume segments; ``engines.routing`` is the hash ring;
  ``engines.http`` maps transport failures to the typed errors of ``engines.types``;
  ``engines.images`` puts a prompt's images (``engines.types.EngineImage``) on the wire.

Conventions: every per-token list is in output-token coordinates; engine input logprobs are
indexed by absolute position; ``-inf`` logprobs are ``-9999.0`` whatever the engine; a chunk
of tokens is stamped with the engine-reported weight version when it is an integer, else with
the pool's version when the chunk was requested. See docs/engines.md.
"""
