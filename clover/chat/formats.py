"""The chat wire format of each model family, as its own chat template writes it (the template in
the model's folder renders prompts; this says what the server writes and reads in a reply):

| family | turn ends with | tool call (one block per call) | tool results |
|---|---|---|---|
| Clover | `<|im_end|>` | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` | user turn of `<tool_response>` blocks |
| SDAR (Qwen3), Fast-dLLM v2 (Qwen2.5) | `<|im_end|>` | the same `<tool_call>` JSON block | user turn of `<tool_response>` blocks |
| LLaDA2 (Ling 2.0) | `<|role_end|>` | the same `<tool_call>` JSON block | `<role>OBSERVATION</role>` turn of `<tool_response>` blocks |

So one frame (calls.py: `CALL_HEAD` ... `CALL_END`, `parse_tool_calls`) serves every family: a
forced call is that scaffold around its arguments, a reply under tool_choice "auto" is parsed for
those blocks. What differs is the token that ends the assistant's turn (`TURN_ENDS`: after a forced
call, the model chooses between it and another call).
"""

from __future__ import annotations

from .template import IM_END

ROLE_END = "<|role_end|>"  # Ling 2.0's end of turn (LLaDA2)
TURN_ENDS = (IM_END, ROLE_END)  # the tokens that end an assistant turn, by family, the first a tokenizer has wins
