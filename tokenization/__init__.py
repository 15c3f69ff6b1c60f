"""Token-level chat handling: loading, rendering, the splice bridge, output parsing. Pure, no I/O."""

from .bridge import BridgeResult
from .chat_format import ChatFormat
from .conversation import Message, Tool, ToolCall
from .loader import load_tokenizer, make_renderer, qwen3_tokenizer_dir, renderer_name_for
from .parse import ParsedCall, ParsedOutput, parse_output

__all__ = [
    "BridgeResult",
    "ChatFormat",
    "Message",
    "ParsedCall",
    "ParsedOutput",
    "Tool",
    "ToolCall",
    "load_tokenizer",
    "make_renderer",
    "parse_output",
    "qwen3_tokenizer_dir",
    "renderer_name_for",
]
