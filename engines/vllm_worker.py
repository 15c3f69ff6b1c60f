"""A vLLM worker extension that leaves vLLM running exactly the published weights.

Start vLLM with ``--worker-extension-cls engines.vllm_worker.SpliceWorkerExtension`` (this file
importable in vLLM's environment: ``PYTHONPATH=/path/to/splice`` or ``pip install --no-deps
splice`` there). Splice sees the class in ``GET /server_info`` and calls its methods through
``POST /collective_rpc`` instead of vLLM's own ``reload_weights``.

Why it exists: vLLM 0.32 reloads weights in place layer by layer, and a layer that received no
checkpoint tensor is put back as it was, without ``process_weights_after_loading``. A tied LM
head (``tie_word_embeddings``: Qwen3-0.6B / 1.7B / 4B) receives nothing (the checkpoint has no
``lm_head.weight``); its parameter shares storage with the embedding, which *is* updated, but
on the CPU build ``UnquantizedEmbeddingMethod.process_weights_after_loading`` had packed a
private copy of that weight for its GEMM (``dispatch_cpu_unquantized_gemm``: a oneDNN handle or
an sgl-kernel packed matrix). That copy is never rebuilt, so after an update vLLM samples with
the new body and the old head. The fix: after the reload, re-run the weight processing of every
layer whose parameters alias another layer's (a tied head), so derived copies are rebuilt from
the live storage. On CUDA the processing is a no-op for an unquantized head and the reload was
already right; the call is then harmless.

This module imports nothing from Splice (it runs inside vLLM's worker processes) and only
``torch`` at call time.
"""

from __future__ import annotations

from typing import Any

#: The qualified name vLLM's ``--worker-extension-cls`` takes, and Splice looks for.
QUALNAME = "engines.vllm_worker.SpliceWorkerExtension"
#: ``collective_rpc`` methods this extension adds (names chosen not to clash with vLLM's).
RELOAD_METHOD = "splice_reload_weights"
REFRESH_METHOD = "splice_refresh_tied"


def aliased_layers(model: Any) -> list[tuple[str, Any]]:
    """Layers owning a parameter that is the same tensor storage as an earlier layer's.

    Module order is registration order, so the embedding (loaded from the checkpoint) comes
    first and the tied head (which shares it) is the one returned.
    """
    seen: dict[int, str] = {}
    tied: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        params = [p for p in module._parameters.values() if p is not None]
        if not params:
            continue
        shared = [p for p in params if p.data_ptr() in seen and p.numel() > 0]
        if shared:
            tied.append((name, module))
        for p in params:
            if p.numel() > 0:
                seen.setdefault(p.data_ptr(), name)
    return tied


def refresh_layers(model: Any) -> list[str]:
    """Re-run ``process_weights_after_loading`` on every aliased layer; the names it touched."""
    done = []
    for name, module in aliased_layers(model):
        method = getattr(module, "quant_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is None:
            continue
        process(module)
        done.append(name)
    return done


class SpliceWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def _splice_model(self) -> Any:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def splice_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """vLLM's in-place ``reload_weights`` from ``weights_path``, then tied layers refreshed."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return {"refreshed": self._splice_refresh()}

    def splice_refresh_tied(self) -> dict[str, Any]:
        """Refresh tied layers after an in-memory weight transfer (which bypasses the reload)."""
        return {"refreshed": self._splice_refresh()}

    def _splice_refresh(self) -> list[str]:
        import torch
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            return refresh_layers(self._splice_model())
