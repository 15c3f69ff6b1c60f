"""The agent workload the proxy benchmarks share (``overhead``, ``soak``, ``recompute``): one system
prompt, one user task and one tool ``f`` the engine stand-in keeps calling, so their numbers
describe the same conversations."""

SYSTEM = "You are a careful agent. Use the tool f to make progress."
USER = "Run the computation until it reaches the end, one step at a time."
TOOL = {"name": "f", "description": "Advance the computation by one step.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}  # fmt: skip
