"""Token-level chat handling: loading, rendering, the splice bridge, output parsing. Pure, no I/O."""

from .bridge import BridgeResult
from .chat_format import ChatFormat
from .conversation import Message, Tool, ToolCall
from .loader import load_tokenizer, make_renderer, qwen3_tokenizer_dir, renderer_name_for
from .parse import ParsedCall, ParsedOutput, parse_output
from .vision import ImageError, ImageInfo, ImageSpan, VisionNotSupported, VisionSpec

__all__ = [
    "BridgeResult",
    "ChatFormat",
    "ImageError",
    "ImageInfo",
    "ImageSpan",
    "Message",
    "ParsedCall",
    "ParsedOutput",
    "Tool",
    "ToolCall",
    "VisionNotSupported",
    "VisionSpec",
    "load_tokenizer",
    "make_renderer",
    "parse_output",
    "qwen3_tokenizer_dir",
    "renderer_name_for",
]
