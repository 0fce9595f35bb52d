"""`clover chat`: an interactive conversation through the chat template, streamed block by block.
Commands: /think (toggle thinking mode), /reset (forget the conversation), /exit (or Ctrl-D).
No tools are offered, so the tool-call frame is never generated (as the server without `tools`); the
thinking block is shown dimmed (or between [thinking] / [answer] lines off a terminal), without its tags."""

from __future__ import annotations

import sys

from .options import add_generation_args, add_model_args, decode_config


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat (streams block by block; /think /reset /exit)")
    add_model_args(p)
    add_generation_args(p)
    p.add_argument("--system", metavar="TEXT", help="a system message")
    p.set_defaults(func=run, max_new_tokens=512)


class ReplyView:
    """What `clover chat` prints of a reply as it grows: the thinking block styled (dim on a terminal,
    between `[thinking]` / `[answer]` lines otherwise), never its literal <think> tags, then the answer.
    `update(text)` takes the whole decoded reply so far and returns what to write now."""

    def __init__(self, think: bool, tty: bool):
        self.think, self.tty = think, tty
        self.sent_reasoning = self.sent_answer = 0
        self.in_reasoning = False

    def split(self, text: str) -> tuple[str, str, bool]:
        """(reasoning, answer, reasoning closed) of the reply so far, tags removed."""
        from ..chat import THINK_CLOSE, THINK_OPEN, split_partial

        if not self.think:
            return "", text.replace(THINK_OPEN, "").replace(THINK_CLOSE, ""), True
        reasoning, answer, closed = split_partial(text.replace(THINK_OPEN, ""))
        return reasoning, answer.replace(THINK_CLOSE, "").lstrip(), closed

    def update(self, text: str, final: bool = False) -> str:
        reasoning, answer, closed = self.split(text)
        if not (closed or final):
            reasoning = reasoning.rstrip()  # trailing white space may be the block's end
        out = []
        new = reasoning[self.sent_reasoning:]
        if new:
            if not self.in_reasoning:
                self.in_reasoning = True
                out.append("\x1b[2m" if self.tty else "[thinking]\n")
            out.append(new)
            self.sent_reasoning = len(reasoning)
        new = answer[self.sent_answer:]
        if (new or final) and self.in_reasoning and (closed or final):
            out.append("\x1b[0m\n\n" if self.tty else "\n[answer]\n")
            self.in_reasoning = False
        if new:
            out.append(new)
            self.sent_answer = len(answer)
        return "".join(out)


def chat_config(model, tokenizer, cfg):
    """The decoding for a chat turn: `clover chat` offers no tools, so the tool-call frame tokens are
    never generated (the same suppressed set as the server's requests without tools)."""
    from dataclasses import replace

    from ..api import decode_config as for_model
    from ..chat import call_frame_ids

    cfg = for_model(model, tokenizer, cfg)
    return replace(cfg, sampling=replace(cfg.sampling, suppress=call_frame_ids(tokenizer, model.config.vocab_size)))


def stream_reply(model, tokenizer, messages, think: bool, cfg) -> str:
    """Print the reply as blocks complete (reasoning styled apart, without its tags); return the full
    decoded text."""
    from ..chat import encode
    from ..engine import Engine

    tty = sys.stdout.isatty()
    dim, reset = ("\x1b[2m", "\x1b[0m") if tty else ("", "")
    view, text = ReplyView(think, tty), ""
    engine = Engine(model, chat_config(model, tokenizer, cfg))
    for seq, _ in engine.stream([encode(tokenizer, messages, chat=True, think=think)]):
        text = tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        sys.stdout.write(view.update(text))
        sys.stdout.flush()
    sys.stdout.write(view.update(text, final=True))
    n = len(seq.token_ids)
    print(f"\n{dim}[{n} tokens, {n / max(seq.forward_passes, 1):.2f} tokens/forward, "
          f"{n / seq.seconds:.1f} tokens/s]{reset}")
    return text


def run(args) -> int:
    from ..api import load
    from ..chat import split_thinking

    cfg = decode_config(args)
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
        text = stream_reply(model, tokenizer, messages, think, cfg)
        messages.append({"role": "assistant", "content": split_thinking(text)[1] if think else text})
