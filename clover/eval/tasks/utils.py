"""Helpers the task YAMLs name with `!function utils.NAME` (lm-eval imports this file by path)."""

from clover.eval import suite
from clover.eval.scoring import last_boxed, math500_process_results, normalize_math  # noqa: F401


def _loader(name):
    def load(**kwargs):  # lm-eval passes the task metadata / dataset_kwargs; the data is fixed by the seed
        return suite.load(name)
    return load


load_arithmetic = _loader("arithmetic")
load_sorting = _loader("sorting")
load_copy = _loader("copy")
load_lookup = _loader("lookup")
load_decisions = _loader("decisions")
load_arithmetic_mc = _loader("arithmetic_mc")
load_word_problems = _loader("word_problems")
