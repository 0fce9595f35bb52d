"""`clover chat`: an interactive conversation through the chat template, streamed block by block.
Commands: /think (toggle thinking mode), /reset (forget the conversation), /exit (or Ctrl-D)."""

from __future__ import annotations

import sys

from .generate import add_decoding_args, add_model_args, decoding_kwargs



def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat (streams block by block; /think /reset /exit)")
    add_model_args(p)
    add_decoding_args(p)
    p.add_argument("--system", metavar="TEXT", help="a system message")
    p.set_defaults(func=run, max_new_tokens=512)


def stream_reply(model, tokenizer, messages, think: bool, kwargs: dict) -> str:
    """Print the reply as blocks complete (reasoning dimmed); return the full decoded text."""
    from ..api import decode_config, encode
    from ..engine import Engine

    dim, reset = ("\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else ("", "")
    engine = Engine(model, decode_config(model, tokenizer, **kwargs))
    shown, end_think = "", "</think>"
    for seq, _ in engine.stream([encode(tokenizer, messages, chat=True, think=think)]):
        text = tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        new, start = text[len(shown):], len(shown)
        shown = text
        close = text.find(end_think)
        reasoning_end = 0 if not think else close + len(end_think) if close >= 0 else len(text)
        dim_part = new[: max(0, reasoning_end - start)]
        sys.stdout.write(f"{dim}{dim_part}{reset}{new[len(dim_part):]}" if dim_part else new)
        sys.stdout.flush()
    n = len(seq.token_ids)
    print(f"\n{dim}[{n} tokens, {n / max(seq.forward_passes, 1):.2f} tokens/forward, "
          f"{n / seq.seconds:.1f} tokens/s]{reset}")
    return shown


def run(args) -> int:
    from ..api import load, split_thinking

    kwargs = decoding_kwargs(args)
    model, tokenizer = load(args.model, args.device)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages, think = list(system), args.think
    print(f"clover chat: /think toggles thinking (now {'on' if think else 'off'}), /reset, /exit")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            messages = list(system)
            print("(conversation reset)")
            continue
        if line == "/think":
            think = not think
            print(f"(thinking {'on' if think else 'off'})")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        text = stream_reply(model, tokenizer, messages, think, kwargs)
        messages.append({"role": "assistant", "content": split_thinking(text)[1] if think else text})
