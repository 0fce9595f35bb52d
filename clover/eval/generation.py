"""Generation with stop strings through the decoding engine: what the lm-eval model's
`generate_until` and `clover bench pareto` both run (no lm-eval import here)."""

from __future__ import annotations

from ..engine import DEFAULTS, DecodeConfig, Engine, SamplingParams


def generate_until(model, tokenizer, contexts: list[str], budgets: list[int], until: list[str], mode=DEFAULTS.mode,
                   block_size=DEFAULTS.block_size, threshold=DEFAULTS.threshold, steps=None, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                   eos_token_ids=()):
    """One batch: each row gets its own token budget, leaves the batch once its text contains a stop
    string, and its text is cut before the first stop string. Returns (texts, engine Sequences)."""
    eos = tuple(eos_token_ids)
    ids = [tokenizer(c).input_ids or [eos[0] if eos else tokenizer.eos_token_id] for c in contexts]
    ctx = model.config.max_position_embeddings
    budgets = [max(1, min(b, ctx - min(len(p), ctx - 1))) for p, b in zip(ids, budgets)]
    ids = [p[-(ctx - b):] for p, b in zip(ids, budgets)]
    cfg = DecodeConfig(mode=mode, block_size=block_size, threshold=threshold, steps=steps, max_new_tokens=max(budgets),
                       eos_token_ids=eos, sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                                                  seed=seed if temperature > 0 else None))
    engine = Engine(model, cfg)
    seqs = engine.add(ids, budgets)
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    while engine.running:
        for seq, _ in engine.step():
            if until and not seq.finished and any(u and u in decode(seq.token_ids) for u in until):
                engine.finish(seq, "stop")
    texts = []
    for seq in seqs:
        text = decode(seq.token_ids)
        for u in until:
            text = text.split(u)[0] if u else text
        texts.append(text)
    return texts, seqs
