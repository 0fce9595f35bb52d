"""The chat / tool-call wire format, in one place: how a conversation becomes prompt text and how a
reply is read back.

* `template` - the chat template (`CHAT_TEMPLATE`, saved with Clover's tokenizer), its Python twin
  (`normalize_messages`, `render_chat`), `encode` (a prompt or messages -> token ids) and
  `prompt_renderer` (a conversation with tools -> prompt text, also for templates that predate tools).
* `think` - the `<think>` ... `</think>` reasoning block: `split_thinking` (finished reply),
  `split_partial` (growing reply), `EMPTY_THINK`.
* `calls` - the `<tool_call>` frame: `format_tool_call`, `parse_tool_calls`, `text_before_call`
  (streaming), `new_call_id`, `call_frame_ids` (the frame's token ids).
* `formats` - each family's end of turn (`TURN_ENDS`: Clover, SDAR and Fast-dLLM v2's `<|im_end|>`,
  LLaDA2's `<|role_end|>`); every family writes its tool calls in the `<tool_call>` frame above.
* `tools` - OpenAI function specs: `validate_tools`, `tool_signature`, `render_tools`.

Nothing here imports torch or another clover package: data, agent, api, server and cli all build on it.
"""

from .calls import (CALL_CLOSE, CALL_END, CALL_FRAME, CALL_HEAD, CALL_OPEN, call_frame_ids, format_tool_call,
                    function_spec, new_call_id, parse_tool_calls, text_before_call)
from .formats import ROLE_END, TURN_ENDS
from .template import (CHAT_TEMPLATE, IM_END, IM_START, encode, normalize_messages, prompt_renderer, render_chat,
                       renders_tools)
from .think import EMPTY_THINK, THINK_CLOSE, THINK_OPEN, after_thinking, split_partial, split_thinking
from .tools import TOOLS_FOOTER, TOOLS_HEADER, ToolSpecError, render_tools, tool_signature, validate_tools

__all__ = ["CALL_CLOSE", "CALL_END", "CALL_FRAME", "CALL_HEAD", "CALL_OPEN", "CHAT_TEMPLATE", "EMPTY_THINK",
           "IM_END", "IM_START", "ROLE_END", "TURN_ENDS", "THINK_CLOSE", "THINK_OPEN", "TOOLS_FOOTER", "TOOLS_HEADER", "ToolSpecError",
           "after_thinking", "call_frame_ids", "encode", "format_tool_call", "function_spec", "new_call_id",
           "normalize_messages", "parse_tool_calls", "prompt_renderer", "render_chat", "renders_tools", "render_tools", "split_partial",
           "split_thinking", "text_before_call", "tool_signature", "validate_tools"]
