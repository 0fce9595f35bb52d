"""bench/families.py runs each family's published loop and Clover's engine on the same random
weights and reports one row per family (the figures are not checked: speed only via benchmarks);
Clover's batch-1 tokens equal the published loop's."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # it imports bench/step.py as `step` (the floor)
spec = importlib.util.spec_from_file_location("bench_families", ROOT / "bench" / "families.py")
families = importlib.util.module_from_spec(spec)
spec.loader.exec_module(families)


def test_one_row_per_family_with_the_same_tokens(capsys):
    assert families.main(["--rounds", "1", "--families", "sdar,llada2", "--new-tokens", "32", "--no-compiled"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| family")]
    assert [r.split("|")[1].strip() for r in rows] == ["sdar", "llada2"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert cells[-1] == "yes" and "x [" in cells[5]
        assert cells[7] == "not run"
    assert "load average" in out


def test_bad_arguments_are_one_line(capsys):
    assert families.main(["--families", "gpt2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "gpt2" in err and "\n" not in err


def test_the_default_width_is_the_published_small_config_and_a_bad_width_is_one_line(capsys):
    cfg = families.family_config("sdar-moe", 256)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["moe_intermediate_size"]) == (256, 768, 4, 2, 128)
    wide = families.family_config("fast-dllm-v2", 1024)
    assert (wide["num_attention_heads"], wide["num_key_value_heads"], wide["intermediate_size"]) == (16, 8, 3072)
    assert families.main(["--hidden", "300"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--hidden" in err and "\n" not in err


def test_the_folder_stores_bf16_as_published_and_both_sides_load_fp32(tmp_path):
    from safetensors import safe_open

    cfg = families.family_config("llada2", 128)
    families.write_folder(tmp_path / "llada2", cfg, peak=1.0, stored=families.STORED["bf16"])
    with safe_open(str(tmp_path / "llada2" / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
    bias = {n for n in dtypes if n.endswith("expert_bias")}
    assert bias and {dtypes[n] for n in bias} == {families.torch.float32}  # LLaDA2 publishes its router bias in fp32
    assert {dtypes[n] for n in dtypes if n not in bias} == {families.torch.bfloat16}
    from clover.models.families import load_family

    model = load_family(tmp_path / "llada2", dtype=families.torch.float32, with_tokenizer=False).model
    assert {p.dtype for p in model.parameters()} == {families.torch.float32}
