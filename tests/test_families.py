"""The public block-diffusion families (SDAR, SDAR-MoE, LLaDA2, Fast-dLLM v2) on random-weight
checkpoints the tests write in each family's published layout (config.json with its architectures
and auto_map, the published tensor names, a tiny tokenizer with the family's mask token and a chat
template). Clover's implementation must give the logits of a reference under the same block mask:
transformers' own Qwen3 / Qwen3-MoE / Qwen2 classes with a 4D additive mask, and for LLaDA2 a naive
model written here from the published modeling code; cached block-by-block == full recompute."""

from __future__ import annotations

import json
import math
import string

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from clover.models.families import FAMILIES, family_of, load_family, read_family_config

QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

AUTO_MAP = {
    "sdar": ("configuration_sdar.SDARConfig", "modeling_sdar.SDARModel", "modeling_sdar.SDARForCausalLM"),
    "sdar_moe": ("configuration_sdar_moe.SDARMoeConfig", "modeling_sdar_moe.SDARMoeModel",
                 "modeling_sdar_moe.SDARMoeForCausalLM"),
    "llada2_moe": ("configuration_llada2_moe.LLaDA2MoeConfig", "modeling_llada2_moe.LLaDA2MoeModel",
                   "modeling_llada2_moe.LLaDA2MoeModelLM"),
    "Fast_dLLM_Qwen": ("configuration.Fast_dLLM_QwenConfig", "modeling.Fast_dLLM_QwenModel",
                       "modeling.Fast_dLLM_QwenForCausalLM"),
}
MASK = {"sdar": "<|MASK|>", "sdar_moe": "<|MASK|>", "llada2_moe": "<|mask|>", "Fast_dLLM_Qwen": "|<MASK>|"}
VOCAB = 96

TINY = {
    "sdar": dict(architectures=["SDARForCausalLM"], model_type="sdar", hidden_size=64, intermediate_size=96,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512),
    "sdar_moe": dict(architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", hidden_size=64,
                     intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                     rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512),
    "llada2_moe": dict(architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", hidden_size=64,
                       intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                       moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1,
                       partial_rotary_factor=0.5, use_bias=False, use_qkv_bias=False, use_qk_norm=True,
                       routed_scaling_factor=2.5, score_function="sigmoid", norm_topk_prob=True,
                       rope_theta=600000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       max_position_embeddings=512),
    "Fast_dLLM_Qwen": dict(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen",
                           hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                           rms_norm_eps=1e-6, bd_size=8, layer_types=["full_attention"] * 2,
                           max_position_embeddings=512),
}


def family_tokenizer(mask_token: str) -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", mask_token]
    chars = list(string.ascii_letters + string.digits + " \n.,!?:;'-()")
    tokens = specials + chars
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:2] + [mask_token])
    fast.chat_template = QWEN_TEMPLATE
    return fast


def random_state(shapes: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        if name.endswith("norm.weight") or "layernorm" in name:
            t = 1 + 0.1 * t
        elif name.endswith("embeddings.weight") or name.endswith("embed_tokens.weight"):
            t = t * 0.5
        elif name.endswith("expert_bias") or name.endswith(".bias"):
            t = t * 0.1
        else:
            t = t / math.sqrt(shape[-1])
        state[name] = t.contiguous()
    return state


def write_family(folder, model_type: str, seed: int = 0, **overrides) -> dict:
    """A random-weight folder in the family's published layout; returns the state dict written."""
    cfg = {**TINY[model_type], **overrides, "vocab_size": VOCAB, "torch_dtype": "float32", "eos_token_id": 2}
    auto = AUTO_MAP[model_type]
    cfg["auto_map"] = {"AutoConfig": auto[0], "AutoModel": auto[1], "AutoModelForCausalLM": auto[2]}
    fam = family_of(cfg)
    state = random_state(fam.config_class().from_dict(cfg).param_shapes(), seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    family_tokenizer(MASK[model_type]).save_pretrained(folder)
    return state


def block_mask(positions, valid, block):
    """[B, Lq, Lk] bool: key j visible to query i iff j is real and its block is not after i's."""
    blk = positions // block
    m = (blk[:, None, :] <= blk[:, :, None]) & valid[:, None, :]
    return m | torch.eye(positions.shape[1], dtype=torch.bool)[None]


def additive(mask):
    return torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, float("-inf"))[:, None]


def batch_inputs(seed=1, batch=2, length=11, pad_rows=(0, 3)):
    """Random ids, left padding per row, positions counting real tokens only."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch, length), generator=g)
    pad = torch.zeros(batch, length, dtype=torch.bool)
    for b, n in enumerate(pad_rows[:batch]):
        pad[b, :n] = True
    positions = ((~pad).long().cumsum(1) - 1).clamp_min(0)
    return ids, pad, positions


# ------------------------------------------------------------------------------------------------
# references
# ------------------------------------------------------------------------------------------------
def hf_reference(folder, model_type):
    """transformers' own class on the same folder (its loader converts the published names)."""
    import transformers

    cfg = dict(TINY[model_type], vocab_size=VOCAB)
    for k in ("architectures", "model_type", "auto_map"):
        cfg.pop(k, None)
    cls_name = {"sdar": "Qwen3", "sdar_moe": "Qwen3Moe", "Fast_dLLM_Qwen": "Qwen2"}[model_type]
    config = getattr(transformers, cls_name + "Config")(**cfg)
    config._attn_implementation = "eager"
    model, info = getattr(transformers, cls_name + "ForCausalLM").from_pretrained(
        str(folder), config=config, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def naive_llada2(state: dict, c: dict, ids, mask, positions):
    """LLaDA2MoeModelLM's forward as the published modeling_llada2_moe.py computes it (eager
    attention with an additive mask, the expert loop), on the published tensor names."""
    def rms(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"]))

    def mlp(x, p):
        return F.linear(F.silu(F.linear(x, state[p + "gate_proj.weight"])) * F.linear(x, state[p + "up_proj.weight"]),
                        state[p + "down_proj.weight"])

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    rd = int(d * c["partial_rotary_factor"])
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, rd, 2).float() / rd))
    freqs = positions[..., None].float() * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x = state["model.word_embeddings.weight"][ids]
    b, n, _ = x.shape
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, state[p + "input_layernorm.weight"])
        qkv = F.linear(h, state[p + "attention.query_key_value.weight"]).view(b, n, nh + 2 * nkv, d)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([nh, nkv, nkv], dim=-2))
        q, k = rms(q, state[p + "attention.query_layernorm.weight"]), rms(k, state[p + "attention.key_layernorm.weight"])
        q = torch.cat([q[..., :rd] * cos + rotate_half(q[..., :rd]) * sin, q[..., rd:]], -1)
        k = torch.cat([k[..., :rd] * cos + rotate_half(k[..., :rd]) * sin, k[..., rd:]], -1)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        w = torch.softmax(q @ k.transpose(2, 3) * d**-0.5 + mask, dim=-1)
        x = x + F.linear((w @ v).transpose(1, 2).reshape(b, n, -1), state[p + "attention.dense.weight"])
        h = rms(x, state[p + "post_attention_layernorm.weight"])
        x = x + (mlp(h, p + "mlp.") if i < c["first_k_dense_replace"] else naive_ling_moe(state, c, h, p + "mlp."))
    x = rms(x, state["model.norm.weight"])
    return F.linear(x, state["lm_head.weight"])


def naive_ling_moe(state, c, h, p):
    flat = h.reshape(-1, h.shape[-1])
    scores = torch.sigmoid(F.linear(flat.float(), state[p + "gate.weight"].float()))
    routing = scores + state[p + "gate.expert_bias"]
    t, e = routing.shape
    g = c["n_group"]
    group_scores = routing.view(t, g, -1).topk(2, dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(c["topk_group"], dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask[:, :, None].expand(t, g, e // g).reshape(t, -1)
    _, idx = routing.masked_fill(~score_mask.bool(), float("-inf")).topk(c["num_experts_per_tok"], dim=-1)
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
    out = torch.zeros_like(flat)
    for tok in range(t):
        for slot in range(idx.shape[1]):
            ep = f"{p}experts.{int(idx[tok, slot])}."
            y = F.linear(F.silu(F.linear(flat[tok], state[ep + "gate_proj.weight"])) * F.linear(flat[tok], state[ep + "up_proj.weight"]),
                         state[ep + "down_proj.weight"])
            out[tok] += w[tok, slot] * y
    sp = p + "shared_experts."
    shared = F.linear(F.silu(F.linear(flat, state[sp + "gate_proj.weight"])) * F.linear(flat, state[sp + "up_proj.weight"]),
                      state[sp + "down_proj.weight"])
    return (out + shared).view_as(h)


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "Fast_dLLM_Qwen"])
@pytest.mark.parametrize("block", [4, 3])
def test_qwen_families_equal_transformers_under_block_mask(tmp_path, model_type, block):
    write_family(tmp_path, model_type)
    loaded = load_family(tmp_path, dtype=torch.float32)
    ref = hf_reference(tmp_path, model_type)
    ids, pad, positions = batch_inputs()
    with torch.no_grad():
        ours = loaded.model(ids, block_size=block, pad=pad)
        mask = block_mask(positions, ~pad, block)
        theirs = ref(input_ids=ids, attention_mask=additive(mask), position_ids=positions).logits
    real = ~pad
    assert (ours[real] - theirs[real]).abs().max() < 1e-5
    assert ours[real].abs().max() > 0.1  # the comparison is not between near-zero tensors


def test_llada2_equals_naive_published_forward(tmp_path):
    state = write_family(tmp_path, "llada2_moe")
    loaded = load_family(tmp_path, dtype=torch.float32)
    ids, pad, positions = batch_inputs(length=13, pad_rows=(2, 0))
    c = TINY["llada2_moe"]
    with torch.no_grad():
        ours = loaded.model(ids, block_size=4, pad=pad)
        theirs = naive_llada2(state, c, ids, additive(block_mask(positions, ~pad, 4)), positions)
    real = ~pad
    assert (ours[real] - theirs[real]).abs().max() < 1e-5
    assert ours[real].abs().max() > 0.1


def test_block_mask_matters(tmp_path):
    """The reference comparison can fail: a causal mask gives other logits than the block mask."""
    write_family(tmp_path, "sdar")
    loaded = load_family(tmp_path, dtype=torch.float32)
    ref = hf_reference(tmp_path, "sdar")
    ids, pad, positions = batch_inputs(pad_rows=(0, 0))
    with torch.no_grad():
        ours = loaded.model(ids, block_size=4)
        causal = ref(input_ids=ids, position_ids=positions).logits
    assert (ours - causal).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "llada2_moe", "Fast_dLLM_Qwen"])
def test_cached_block_by_block_equals_full_recompute(tmp_path, model_type):
    write_family(tmp_path, model_type)
    model = load_family(tmp_path, dtype=torch.float32).model
    block, total = 4, 15  # blocks 0-3 committed one by one, the last (partial) block a draft
    ids = torch.randint(4, VOCAB, (2, total), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids, block_size=block)
        cache = model.new_cache(2, capacity=4)  # grows while committing
        got = []
        for start in range(0, total, block):
            chunk = ids[:, start:start + block]
            n = start  # committed so far (both rows)
            lens, keys = cache.lens.clone(), [k[:, :, :n].clone() for k in cache.key.values()]
            draft = model(chunk, cache=cache, block_size=block)  # not committed: the committed slots are as they were
            assert torch.equal(cache.lens, lens) and all(torch.equal(a[:, :, :n], b) for a, b in zip(cache.key.values(), keys))
            clean = model(chunk, cache=cache, commit=True, block_size=block)
            assert (draft - clean).abs().max() < 1e-5  # same tokens: the draft pass equals the commit pass
            got.append(draft)
    assert (torch.cat(got, 1) - full).abs().max() < 1e-5
    assert cache.lens.tolist() == [total, total]


def test_cache_rows_ragged_commit_and_select(tmp_path):
    """Left-padded rows commit only their real tokens; select_rows / append_rows keep rows intact."""
    write_family(tmp_path, "sdar")
    model = load_family(tmp_path, dtype=torch.float32).model
    ids, pad, positions = batch_inputs(length=8, pad_rows=(0, 3))
    nxt = torch.randint(4, VOCAB, (2, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = model.new_cache(2)
        model(ids, cache=cache, commit=True, block_size=4, pad=pad)
        assert cache.lens.tolist() == [8, 5]
        step = model(nxt, cache=cache, block_size=4)
        one = model.new_cache(1)
        model(ids[1:, 3:], cache=one, commit=True, block_size=4)
        alone = model(nxt[1:], cache=one, block_size=4)
        assert (step[1:] - alone).abs().max() < 1e-5
        cache.select_rows([1])
        cache.append_rows(one)
        both = model(nxt[[1, 1]], cache=cache, block_size=4)
    assert (both[0] - both[1]).abs().max() < 1e-5 and (both[0] - alone[0]).abs().max() < 1e-5


def test_family_properties_and_settings(tmp_path):
    from clover.models.modeling_fast_dllm import FastDLLMForCausalLM
    from clover.models.modeling_llada2 import LLaDA2MoeModelLM
    from clover.models.modeling_sdar import SDARForCausalLM, SDARMoeForCausalLM

    assert (SDARForCausalLM.shift, SDARForCausalLM.mask_token_id, SDARForCausalLM.default_block_size) == (False, 151669, 4)
    assert SDARMoeForCausalLM.mask_token_id == 151669 and not SDARMoeForCausalLM.shift
    assert (LLaDA2MoeModelLM.shift, LLaDA2MoeModelLM.mask_token_id, LLaDA2MoeModelLM.default_block_size) == (False, 156895, 32)
    assert (FastDLLMForCausalLM.shift, FastDLLMForCausalLM.default_block_size, FastDLLMForCausalLM.default_sub_block_size,
            FastDLLMForCausalLM.default_threshold) == (True, 32, 8, 0.9)
    assert all(m.block_align == "absolute" for m in (SDARForCausalLM, LLaDA2MoeModelLM, FastDLLMForCausalLM))
    write_family(tmp_path / "f", "Fast_dLLM_Qwen")
    (tmp_path / "f" / "generation_config.json").write_text(json.dumps({"threshold": 0.8}))
    loaded = load_family(tmp_path / "f")
    assert (loaded.block_size, loaded.threshold) == (8, 0.8)  # bd_size from config.json, threshold published
    assert loaded.mask_token_id == loaded.tokenizer.convert_tokens_to_ids("|<MASK>|") == 3
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    write_family(tmp_path / "s", "sdar")
    assert load_family(tmp_path / "s").block_size == 4


def test_unknown_family_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError) as e:
        read_family_config(tmp_path)
    assert "\n" not in str(e.value) and "LlamaForCausalLM" in str(e.value)
    assert {f.name for f in FAMILIES} == {"sdar", "sdar_moe", "llada2", "fast_dllm_v2"}


def test_weights_that_do_not_fit_are_refused(tmp_path):
    state = write_family(tmp_path, "llada2_moe")
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="expert tensor"):
        load_family(tmp_path)


# ------------------------------------------------------------------------------------------------
# published generate loops (clover/models/reference_generate.py)
# ------------------------------------------------------------------------------------------------
def confident(folder, model_type, peak=30.0):
    """The family's model with its head scaled up, so thresholds pass and several tokens fill per step."""
    loaded = load_family(folder, dtype=torch.float32)
    head = loaded.model.head_weight()
    head.data *= peak
    return loaded


def test_sdar_generate_is_the_uncached_block_loop(tmp_path):
    """The cached published loop equals the same algorithm written without a cache (every step a
    full recompute under the block mask), and its first block completes the prompt's partial block."""
    from clover.models.reference_generate import sdar_generate, transfer_counts

    write_family(tmp_path, "sdar")
    loaded = confident(tmp_path, "sdar")
    model, mask = loaded.model, loaded.mask_token_id
    prompt = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    out, forwards = sdar_generate(model, prompt, mask, gen_length=10, block_length=4, threshold=0.5)
    x = torch.full((1, 16), mask)
    x[:, :6] = prompt
    naive_forwards = 0
    for b in range(1, 4):
        for step in range(5):
            cur = x[:, 4 * b:4 * b + 4]
            if not (cur == mask).any():
                break
            logits = model(x[:, :4 * b + 4], block_size=4)[:, -4:]
            probs = logits.index_fill(-1, torch.tensor([mask]), float("-inf")).softmax(-1)
            naive_forwards += 1
            p, x0 = probs.max(-1)
            conf = torch.where(cur == mask, p, float("-inf"))[0]
            n = transfer_counts(4, 4)[step]
            pick = conf > 0.5 if int((conf > 0.5).sum()) >= n else torch.zeros(4, dtype=torch.bool).index_fill(0, conf.topk(n).indices, True)
            cur[0, pick] = x0[0, pick]
    assert torch.equal(out, x) and torch.equal(out[:, :6], prompt)
    assert forwards == naive_forwards + 1 + 3  # + the prefill and one clean commit per block
    assert naive_forwards < 10  # the threshold filled several tokens per forward


@pytest.mark.parametrize("strategy", ["low_confidence_static", "sequential"])
def test_sdar_static_strategies_fill_one_per_step(tmp_path, strategy):
    from clover.models.reference_generate import sdar_generate

    write_family(tmp_path, "sdar")
    loaded = load_family(tmp_path, dtype=torch.float32)
    prompt = torch.randint(4, VOCAB, (2, 4), generator=torch.Generator().manual_seed(2))
    out, forwards = sdar_generate(loaded.model, prompt, loaded.mask_token_id, 8, 4, strategy=strategy)
    assert not (out == loaded.mask_token_id).any() and forwards == 1 + 2 * (4 + 1)


def test_llada2_generate_equals_cached_block_decoding(tmp_path):
    """LLaDA2's published loop (the whole prefix recomputed each step, no cache) and SDAR's (cached,
    committed clean per block) publish the same threshold rule: on one model they give the same
    tokens, the cached one with fewer positions computed."""
    from clover.models.reference_generate import llada2_generate, sdar_generate

    write_family(tmp_path, "llada2_moe")
    loaded = confident(tmp_path, "llada2_moe")
    model, mask = loaded.model, loaded.mask_token_id
    prompt = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    out, forwards = llada2_generate(model, prompt, mask, gen_length=11, block_length=4, steps=4, threshold=0.6)
    cached, cached_forwards = sdar_generate(model, prompt, mask, gen_length=11, block_length=4, threshold=0.6)
    assert torch.equal(out, cached) and not (out == mask).any() and torch.equal(out[:, :5], prompt)
    assert forwards < 12 and cached_forwards == forwards + 1 + 3  # prefill + one commit per block


def test_fast_dllm_generate_shift_and_sub_blocks(tmp_path):
    from clover.models.reference_generate import fast_dllm_generate

    write_family(tmp_path, "Fast_dLLM_Qwen")
    loaded = confident(tmp_path, "Fast_dLLM_Qwen")
    model, mask = loaded.model, loaded.mask_token_id
    prompt = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(6))  # one whole block
    out, forwards = fast_dllm_generate(model, prompt, mask, max_new_tokens=16, block_size=8, small_block_size=4,
                                       threshold=0.9)
    assert out.shape[1] == 8 + 1 + 16 and not (out == mask).any()
    # the token after the prompt is the AR prediction of the prompt's last position (shift)
    assert int(out[0, 8]) == int(model(prompt, block_size=8)[0, -1].argmax())  # the published AR step
    # threshold above any probability: one token per forward (the most confident), plus the commits
    _, slow = fast_dllm_generate(model, prompt, mask, max_new_tokens=16, block_size=8, small_block_size=4,
                                 threshold=1.0)
    assert slow == 1 + 2 * (7 + 1) and forwards < slow


# ------------------------------------------------------------------------------------------------
# presets, exact counts, clover info
# ------------------------------------------------------------------------------------------------
# Published figures (model cards): (total, non-embedding, active, active non-embedding), in the
# precision the card states; None where the card gives none.
PUBLISHED = {
    "sdar-1.7b": ("1.7B", "1.4B", None, None),  # Qwen3-1.7B card
    "sdar-4b": ("4.0B", "3.6B", None, None),  # Qwen3-4B card
    "sdar-8b": ("8.2B", "6.95B", None, None),  # Qwen3-8B card
    "sdar-30b-a3b": ("30.5B", "29.9B", "3.3B", None),  # Qwen3-30B-A3B card
    "llada2-mini": ("16B", None, "1.4B", "789M"),  # LLaDA2.0-mini / Ling-mini-2.0 cards
    "fast-dllm-v2-7b": ("7.61B", "6.53B", None, None),  # Qwen2.5-7B-Instruct card
    "fast-dllm-v2-1.5b": ("1.54B", "1.31B", None, None),  # Qwen2.5-1.5B-Instruct card
}


def _rounds_to(count: int, figure: str) -> bool:
    """The card's figure is the count rounded or cut to the digits it shows (cards do both)."""
    unit = {"B": 1e9, "M": 1e6}[figure[-1]]
    digits = len(figure[:-1].partition(".")[2])
    value = count / unit
    return float(figure[:-1]) in (round(value, digits), math.floor(value * 10**digits) / 10**digits)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_counts(name):
    from clover.presets import FAMILY_PRESETS
    from clover.sizes import family_stats

    values = FAMILY_PRESETS[name]
    stats = family_stats(family_of(values).config_class().from_dict(values))
    keys = ("total_params", "non_embedding_params", "active_params", "active_non_embedding_params")
    for key, figure in zip(keys, PUBLISHED[name]):
        if figure is not None:
            assert _rounds_to(stats[key], figure), (name, key, stats[key], figure)
    assert not _rounds_to(stats["total_params"] + stats["total_params"] // 20, PUBLISHED[name][0])  # can fail


def test_counts_equal_the_loaded_model(tmp_path):
    from clover.sizes import family_stats

    for model_type in TINY:
        write_family(tmp_path / model_type, model_type)
        fam, config = read_family_config(tmp_path / model_type)
        model = load_family(tmp_path / model_type, with_tokenizer=False).model
        assert family_stats(config)["total_params"] == sum(p.numel() for p in model.parameters())


def test_info_on_a_family_folder_and_preset(tmp_path, capsys):
    from clover.cli import main

    write_family(tmp_path, "sdar_moe")
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["family"], info["block_size"], info["mask_token_id"], info["shift"]) == ("sdar_moe", 4, 3, False)
    assert info["total_params"] > info["active_params"] and info["memory_plan"]["total_bytes"] > 0
    assert main(["info", "--preset", "llada2-mini"]) == 0
    out = capsys.readouterr().out
    assert "16,255,638,528" in out and "mask id 156895" in out and "block 32" in out
    assert main(["info", "--preset", "fast-dllm-v2-7b", "--quant", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bf16 plan only" in err


@pytest.mark.parametrize("model_type", ["sdar", "Fast_dLLM_Qwen"])
def test_commit_and_draft_in_one_forward(tmp_path, model_type):
    """[finished block ; next draft] in one forward (commit = the block's length) equals the clean
    commit pass followed by the draft pass, and commits the block only."""
    write_family(tmp_path, model_type)
    model = load_family(tmp_path, dtype=torch.float32).model
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        one, two = model.new_cache(2), model.new_cache(2)
        model(ids[:, :4], cache=one, commit=True, block_size=4)
        model(ids[:, :4], cache=two, commit=True, block_size=4)
        model(ids[:, 4:8], cache=one, commit=True, block_size=4)
        apart = model(ids[:, 8:], cache=one, block_size=4)
        fused = model(ids[:, 4:], cache=two, commit=4, block_size=4)
        assert two.lens.tolist() == [8, 8] and (fused[:, 4:] - apart).abs().max() < 1e-5
        assert (model(ids[:, 8:], cache=two, block_size=4) - apart).abs().max() < 1e-5


def test_cache_rollback_copy_and_pad_rows(tmp_path):
    """The CloverCache calls the engine makes: a recorded commit rolled back to `keep` tokens per row
    leaves the cache a commit of those tokens would; copy_rows is independent; pad_rows writes through."""
    write_family(tmp_path, "Fast_dLLM_Qwen")
    model = load_family(tmp_path, dtype=torch.float32).model
    ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(9))
    nxt = ids[:, 7:9]
    with torch.no_grad():
        cache = model.new_cache(2)
        model(ids[:, :4], cache=cache, commit=True, block_size=1)
        cache.start_recording()
        model(ids[:, 4:8], cache=cache, commit=True, block_size=1)
        cache.rollback(torch.tensor([3, 1]))
        assert cache.lens.tolist() == [7, 5]
        fork = cache.copy_rows([0])
        got = model(nxt[:1], cache=fork, block_size=1)
        ref = model.new_cache(1)
        model(ids[:1, :7], cache=ref, commit=True, block_size=1)
        assert (got - model(nxt[:1], cache=ref, block_size=1)).abs().max() < 1e-5
        assert cache.lens.tolist() == [7, 5]  # the fork's reads left the original alone
        padded = cache.pad_rows(4)
        model(torch.cat([nxt, nxt]), cache=padded, commit=True, block_size=1)
        assert padded.lens.tolist() == [9, 7, 2, 2]
        assert torch.equal(cache.key[0][:, :, 7:9], padded.key[0][:2, :, 7:9])  # written through the views


@pytest.mark.parametrize("field, value", [("use_sliding_window", True), ("rope_scaling", {"rope_type": "yarn"}),
                                          ("hidden_act", "gelu")])
def test_unsupported_variants_are_refused_in_one_line(tmp_path, field, value, capsys):
    from clover.cli import main

    write_family(tmp_path, "Fast_dLLM_Qwen")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError):
        load_family(tmp_path)
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("model_type", ["sdar", "sdar_moe", "Fast_dLLM_Qwen"])
def test_published_loops_over_transformers_equal_clover(tmp_path, model_type):
    """The published loop over transformers' own model (the benchmark baseline) and over Clover's
    give the same tokens in the same forwards."""
    from clover.models.reference_generate import TransformersBlockLM, fast_dllm_generate, sdar_generate

    write_family(tmp_path, model_type)
    loaded = confident(tmp_path, model_type)
    hf = hf_reference(tmp_path, model_type)
    hf.get_output_embeddings().weight.data.copy_(loaded.model.head_weight())
    hf.get_input_embeddings().weight.data.copy_(loaded.model.model.embed.weight)
    prompt = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(11))
    if model_type == "Fast_dLLM_Qwen":
        run = lambda m: fast_dllm_generate(m, prompt, loaded.mask_token_id, 16, 8, 4, threshold=0.7)  # noqa: E731
    else:
        run = lambda m: sdar_generate(m, prompt, loaded.mask_token_id, 10, 4, threshold=0.6)  # noqa: E731
    ours, n_ours = run(loaded.model)
    theirs, n_theirs = run(TransformersBlockLM(hf))
    assert torch.equal(ours, theirs) and n_ours == n_theirs and not (ours == loaded.mask_token_id).any()


def test_llada21_editing_decode(tmp_path):
    """Editing off (or a threshold no probability passes) is LLaDA2.0's loop; editing on replaces
    decoded tokens the model now predicts otherwise, never the prompt's, and stops a block once a
    forward changes nothing."""
    from clover.models.reference_generate import llada2_generate

    write_family(tmp_path, "llada2_moe")
    loaded = confident(tmp_path, "llada2_moe", peak=3.0)
    model, mask = loaded.model, loaded.mask_token_id
    prompt = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(12))
    base, n_base = llada2_generate(model, prompt, mask, 10, 4, 4, threshold=0.3)
    never, n_never = llada2_generate(model, prompt, mask, 10, 4, 4, threshold=0.3, editing_threshold=1.0,
                                     max_post_steps=4)
    assert torch.equal(base, never) and n_never == n_base + 3  # one post step per block finds nothing to edit
    edited, n_edit = llada2_generate(model, prompt, mask, 10, 4, 4, threshold=0.3, editing_threshold=0.0,
                                     max_post_steps=4)
    assert torch.equal(edited[:, :6], prompt) and not (edited == mask).any() and n_edit >= n_never
    assert not torch.equal(edited, base)  # with every change allowed, some decoded token was revised


def test_bf16_checkpoint_loads_in_bf16(tmp_path):
    """A published bf16 folder (the router's expert bias kept in fp32) loads in bf16 unless told."""
    state = write_family(tmp_path, "llada2_moe")
    save_file({k: (v if k.endswith("expert_bias") else v.to(torch.bfloat16)) for k, v in state.items()},
              str(tmp_path / "model.safetensors"))
    model = load_family(tmp_path, with_tokenizer=False).model
    assert model.head_weight().dtype == torch.bfloat16
    ids = torch.randint(4, VOCAB, (1, 7))
    full = load_family(tmp_path, dtype=torch.float32, with_tokenizer=False).model
    with torch.no_grad():
        diff = (model(ids, block_size=4).float() - full(ids, block_size=4)).abs()
    assert diff.mean() < 0.1  # bf16 rounding (an expert choice may flip on a near tie)
