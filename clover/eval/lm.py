"""The `clover` model for lm-evaluation-harness (registered when `clover.eval` is imported).

    lm-eval / clover eval --model clover --model_args pretrained=DIR,block_size=32,threshold=0.95,mode=low_confidence,max_batch=16

* `generate_until`: our decoding engine (any mode of `clover.engine.MODES`), requests batched up to
  `max_batch` rows with per-row budgets (`max_gen_toks`); a row leaves the batch as soon as its text
  contains a stop string (`until`), and the text is cut there.
* `loglikelihood` / `loglikelihood_rolling`, chosen by `likelihood=`:
  - `ar` (default): the exact log-likelihood of the model read as a causal LM (block size 1 is
    exactly a causal LM, docs/architecture.md): one forward per batch, deterministic, and
    `is_greedy` = every continuation token is the argmax.
  - `elbo`: the block-diffusion ELBO at `likelihood_block_size` (default `block_size`), a Monte-Carlo
    estimate over `elbo_samples` noise draws with a fixed seed (`elbo_seed`), through the training
    objective's own noise and layout (`clover.training.objectives.sample_noise`, the [x_t ; x_0]
    forward, `diffusion_loss_from_logits`): log p(cont | ctx) >= -E_t[ sum_masked CE / t ] with
    t ~ U[eps, 1-eps] per window and complementary masks (each draw is paired with its complement,
    halving the variance). Only continuation tokens are ever masked; the context stays clean.
    `is_greedy` comes from one extra pass with the whole continuation masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..engine import DEFAULTS

LIKELIHOODS = ("ar", "elbo")


def _bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("clover")
class CloverLM(TemplateLM):
    last = None  # the latest instance (so `clover eval` can report its generation statistics)

    def __init__(self, pretrained=None, block_size: int = DEFAULTS.block_size, threshold: float = DEFAULTS.threshold,
                 mode: str = DEFAULTS.mode,
                 max_batch: int = 16, steps: int | None = None, likelihood: str = "ar", likelihood_block_size=None,
                 elbo_samples: int = 16, elbo_seed: int = 1234, elbo_eps: float = 1e-3, max_length=None,
                 device=None, dtype=None, batch_size=None, max_batch_size=None, max_gen_toks: int = 256, **kwargs):
        super().__init__()
        from ..api import eos_ids, load
        from ..settings import DecodeConfig, check_block_size

        if likelihood not in LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {', '.join(LIKELIHOODS)}, got {likelihood!r}")
        # built and checked before any model loads (a bad mode / threshold fails at once); model_args are text
        decoding = DecodeConfig.from_settings(mode=mode, block_size=block_size, threshold=threshold, steps=steps)
        if isinstance(pretrained, torch.nn.Module):  # (model, tokenizer) objects from Python
            self.model, self.tokenizer = pretrained, kwargs.pop("tokenizer")
        else:
            device = None if device in (None, "", "auto") else device
            dt = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else None
            self.model, self.tokenizer = load(pretrained, device=device, dtype=dt)
        self.model.eval()
        self.block_size, self.threshold, self.mode = decoding.block_size, decoding.threshold, decoding.mode
        self.steps = decoding.steps
        # lm-eval's --batch_size (default 1) raises the batch only when given above 1: `max_batch` rules
        bs = int(batch_size) if str(batch_size or "").isdigit() else 1
        self.max_batch = max(int(max_batch), bs)
        self.likelihood = likelihood
        self.lik_block = int(likelihood_block_size or block_size)
        self.elbo_samples, self.elbo_seed, self.elbo_eps = int(elbo_samples), int(elbo_seed), float(elbo_eps)
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length else self.model.config.max_position_embeddings
        self.eos = eos_ids(self.model, self.tokenizer)
        self.stats = {"generated_tokens": 0, "forward_passes": 0, "seconds": 0.0}
        CloverLM.last = self
        self.decoding = decoding.check(self.model)
        try:
            check_block_size(self.lik_block, self.model)
        except ValueError as e:
            raise ValueError(f"likelihood_{e}") from None

    # ---- basics --------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.eos[0] if self.eos else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self.model.device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "clover").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, enable_thinking=False)

    # ---- likelihood ----------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: ((context, continuation), context_ids, continuation_ids) -> (logprob, is_greedy)."""
        out: list = [None] * len(requests)
        pairs = []
        for i, (_, ctx, cont) in enumerate(requests):
            ids = (list(ctx) + list(cont))[-self.max_length:]
            n = min(len(cont), len(ids) - 1)  # tokens scored: at least one token of context stays
            pairs.append((i, ids, n))
        if self.likelihood == "ar":
            order = sorted(pairs, key=lambda p: -len(p[1]))
            bar = tqdm(total=len(order), disable=disable_tqdm, desc="clover loglikelihood (ar)")
            for s in range(0, len(order), self.max_batch):
                chunk = order[s:s + self.max_batch]
                for (i, _, _), res in zip(chunk, self._ar_scores([(ids, n) for _, ids, n in chunk])):
                    out[i] = res
                bar.update(len(chunk))
            bar.close()
        else:
            for i, ids, n in tqdm(pairs, disable=disable_tqdm, desc="clover loglikelihood (elbo)"):
                out[i] = self._elbo_score(ids, n)
        for (key, _, _), res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    @torch.no_grad()
    def _ar_scores(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """Causal log-probs of the last n tokens of each row; rows right-padded (causal: padding after
        a row never reaches it)."""
        width = max(len(ids) for ids, _ in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (ids, _) in enumerate(rows):
            batch[r, :len(ids)] = torch.tensor(ids)
        logp = F.log_softmax(self.model(batch.to(self.device)).logits.float(), dim=-1)
        res = []
        for r, (ids, n) in enumerate(rows):
            L = len(ids)
            lp = logp[r, L - n - 1:L - 1]
            tgt = batch[r, L - n:L].to(self.device)
            tok = lp.gather(-1, tgt[:, None])[:, 0]
            res.append((float(tok.sum()), bool((lp.argmax(-1) == tgt).all())))
        return res

    @torch.no_grad()
    def _elbo_score(self, ids: list[int], n: int) -> tuple[float, bool]:
        from ..training.objectives import diffusion_loss_from_logits, sample_noise

        B = self.lik_block
        if B == 1:
            return self._ar_scores([(ids, n)])[0]
        row = torch.tensor([ids], device=self.device)
        loss_mask = torch.zeros_like(row, dtype=torch.bool)
        loss_mask[:, len(ids) - n:] = True
        mask_id = self.model.config.mask_token_id
        gen = torch.Generator(device=self.device).manual_seed(self.elbo_seed)  # same noise for every request
        k = max(1, self.elbo_samples // 2)  # draws; each comes with its complement
        rows = row.expand(k, -1)
        xt, masked, weight = sample_noise(rows, loss_mask.expand(k, -1), B, self.elbo_eps, 1 - self.elbo_eps,
                                          mask_id, gen, complementary=True)
        x0 = torch.cat([rows, rows])
        total = 0.0
        for s in range(0, x0.shape[0], self.max_batch):
            sl = slice(s, s + self.max_batch)
            logits = self.model(x0[sl], noisy_input_ids=xt[sl], block_size=B).logits
            for r in range(logits.shape[0]):
                total += float(diffusion_loss_from_logits(logits[r:r + 1], x0[sl][r:r + 1], masked[sl][r:r + 1],
                                                          weight[sl][r:r + 1], 1))
        elbo = -total / x0.shape[0]
        # greedy: every continuation token is the argmax with the whole continuation masked
        xt1, masked1, _ = sample_noise(row, loss_mask, B, 1.0, 1.0, mask_id, gen)
        logits = self.model(row, noisy_input_ids=xt1, block_size=B).logits[0]
        tgt = row[0, 1:]
        sel = masked1[0, :-1]
        greedy = bool((logits[:-1].argmax(-1)[sel] == tgt[sel]).all())
        return elbo, greedy

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="clover loglikelihood_rolling"):
            (string,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(string), self.prefix_token_id, self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows], disable_tqdm=True)
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # ---- generation ----------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list = [None] * len(requests)
        groups: dict = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(kw.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            if not _bool(kw.pop("do_sample", False)):
                temperature = 0.0
            key = (temperature, float(kw.pop("top_p", 1.0) or 1.0), int(kw.pop("top_k", 0) or 0), tuple(until))
            groups.setdefault(key, []).append((i, context, budget))
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="clover generate_until")
        for (temperature, top_p, top_k, until), items in groups.items():
            items.sort(key=lambda x: -len(x[1]))
            for s in range(0, len(items), self.max_batch):
                chunk = items[s:s + self.max_batch]
                texts = self._generate([c for _, c, _ in chunk], [b for _, _, b in chunk], list(until),
                                       temperature, top_p, top_k)
                for (i, context, _), text in zip(chunk, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), text)
                bar.update(len(chunk))
        bar.close()
        return out

    def _generate(self, contexts, budgets, until, temperature, top_p, top_k) -> list[str]:
        from .generation import generate_until

        texts, seqs = generate_until(self.model, self.tokenizer, contexts, budgets, until, self.mode, self.block_size,
                                     self.threshold, self.steps, temperature, top_p, top_k, self.elbo_seed, self.eos)
        for seq in seqs:
            self.stats["generated_tokens"] += len(seq.token_ids)
            self.stats["forward_passes"] += seq.forward_passes
            self.stats["seconds"] += seq.seconds
        return texts
