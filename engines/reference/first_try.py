"""What the bundled tiny model answers in a first try.

The bundled model is random (untrained): sampled freely it never writes an end of turn, so an
agent CLI pointed at it would wait for the whole context to fill. ``splice serve`` with no
engine and no model of your own therefore runs it in script mode with this reply: the engine
emits it token by token, scoring every token with the model (real logprobs, recorded and
trainable like any turn), and the turn ends, so ``codex exec`` and ``claude -p`` finish in
seconds. ``--reference-script none`` samples the model instead (each turn then stops at
``SAMPLED_MAX_OUTPUT_TOKENS``: it never ends on its own).
"""

from __future__ import annotations

FIRST_TRY_SCRIPT = [
    "<think>\nA scripted reply.\n</think>\n\n"
    "Hello from Splice! The bundled tiny model is untrained, so this reply is scripted; the model "
    "scored each token and your session recorded it. Use --engine-url for a real model.<|im_end|>",
]

# The bundled model sampled without a script never ends its turn: cap each turn's output
# (a model of your own, or a real engine, keeps "as much as fits in the context").
SAMPLED_MAX_OUTPUT_TOKENS = 256
