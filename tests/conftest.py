import pytest
import torch

pytest_plugins = ["pytester"]  # tests/test_suite_split.py runs the marking on a made-up suite

# Tiny test tensors: one thread avoids OpenMP spin overhead, which on a shared 2-core box made
# small forwards many times slower with two threads.
torch.set_num_threads(1)

# Tests that compile with inductor (or build the C++ kernels for another CPU): most of the suite's
# time. They carry the `compiled` marker: `make test` leaves them out, `make test-compiled` runs
# only them, and .ci/run runs both. Whole modules (None), or test functions of a module (where a
# function has a `compiled` parameter, only its compiled cases). All of them share inductor's
# on-disk cache (TORCHINDUCTOR_CACHE_DIR, by default one per user under the temp dir), so a graph
# compiled by one test or run is loaded, not compiled again, by the next.
COMPILED = {
    "test_runner_compiled.py": None,
    "test_server_startup.py": {"test_the_child_compiles_into_the_disk_cache_and_the_server_loads_it"},
    "test_families_compiled.py": None,
    "test_editing_mode.py": {"test_compiled_runner_gives_the_eager_tokens"},
    "test_runner_compiled_quant.py": None,
    "test_ops.py": {"test_local_window_attention_matches_naive_same_window_mask", "test_gathered_experts_compiled_match_naive",
                    "test_compiled_graphs_call_the_ops_c_entry_points", "test_tiled_kernels_built_for_other_cpus_match_naive",
                    "test_compiled_step_into_updates_the_state_in_place",
                    "test_compiled_masked_attention_takes_decode_attention_for_one_query_row"},
    "test_int4_q8.py": {"test_kernels_built_for_other_cpus_match_naive"},
}


# Tests that start several processes (torchrun ranks over gloo) or run whole CLI commands in
# subprocesses: minutes on a 2-core machine, and many times that when it is busy. They carry the
# `slow` marker: `make test` leaves them out, `make test-slow` runs them, and .ci/run runs it.
SLOW = {
    "test_distributed_infer.py": None,
    "test_distributed_train.py": None,
    "test_cli_generate.py": {"test_bench_decode_long_workload"},
    "test_families_quant.py": {"test_cli_generate_on_an_int4_family_folder"},
    "test_families_engine.py": {"test_cli_generate_on_a_family_folder"},
    "test_families_structured.py": {"test_cli_generate_json_schema"},
    "test_family_select.py": {"test_sub_block_steps_ask_for_their_head"},
    "test_long_context.py": {"test_prefill_and_decode_allocations_grow_at_most_linearly"},
}


def is_compiled(item) -> bool:
    names = COMPILED.get(item.path.name, ())
    if names is None:
        return True
    if item.originalname not in names:
        return False
    params = getattr(item, "callspec", None)
    return params is None or params.params.get("compiled", True) is not False


def is_slow(item) -> bool:
    names = SLOW.get(item.path.name, ())
    return names is None or item.originalname in names


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_compiled(item):
            item.add_marker(pytest.mark.compiled)
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Clover model folder (tests/helpers.py), one per test module that asks for it."""
    from helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
