"""The DeepSeek V4.1 chat format: messages -> prompt text (encoder), completion text ->
reasoning, content and OpenAI tool calls (parser, incremental for streaming)."""
from engramflow.chat.encoder import ChatOptions, encode_chat
from engramflow.chat.parser import CompletionParser, parse_completion

__all__ = ["ChatOptions", "encode_chat", "CompletionParser", "parse_completion"]
