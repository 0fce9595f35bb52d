"""Run under torchrun by tests/test_distributed_infer.py: greedy generation with the model sharded
--tp 2 and --ep 2 in every decoding mode, rank 0 driving; it writes the token ids to a JSON file."""

import json
import sys

import torch
from transformers import AutoTokenizer

from clover.api import generate
from clover.distributed import runtime
from clover.distributed.parallel import attach, load_parallel
from clover.structured import generate_json
from distributed_utils import SCHEMA

folder, out_file = sys.argv[1], sys.argv[2]
prompts = json.loads(sys.argv[3])
modes = sys.argv[4].split(",")
torch.set_num_threads(1)
d = runtime.from_env("cpu")
tok = AutoTokenizer.from_pretrained(folder)
results = {}
for kind in ("tp", "ep"):
    shard = load_parallel(folder, 2 if kind == "tp" else 1, 2 if kind == "ep" else 1, d.rank, d.device, torch.float32)
    model = attach(shard, d)  # ranks > 0 mirror rank 0's calls until it releases them
    if model is not None:
        for mode in modes:
            gens = generate(model, tok, prompts, max_new_tokens=20, block_size=8, mode=mode)
            results[f"{kind}/{mode}"] = [g.token_ids for g in gens]
        results[f"{kind}/json"] = generate_json(model, tok, "A person:", SCHEMA, block_size=8, max_new_tokens=40).text
        model.driver.release()
if d.main:
    with open(out_file, "w") as f:
        json.dump(results, f)
runtime.shutdown()
