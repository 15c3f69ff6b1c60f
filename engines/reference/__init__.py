"""CPU reference engine: a real HTTP server speaking the SGLang and vLLM subsets Splice uses.

Entry points: ``server.create_app`` / ``server.main`` (``python -m engines.reference``),
``model_init.init_model`` / ``perturb_model`` / ``ensure_model`` for tiny Qwen3 models, and
``testing.start_engine`` to run one as a subprocess in tests. Imports are lazy so importing
this package does not load torch.
"""
