"""Evaluation: the `clover` model for lm-evaluation-harness and the offline task suite.

Importing this package registers the lm-eval model `clover` (when lm-eval is installed:
`pip install clover-dllm[eval]`). `TASKS_DIR` holds the task YAMLs (`--include_path`);
`clover.eval.suite` builds their seeded JSONL data. See docs/evaluation.md.
"""

from __future__ import annotations

from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
HUB_TASKS = ("clover_gsm8k", "clover_math500")  # need the Hugging Face hub for their data

try:
    import lm_eval.models  # noqa: F401  (fills the registry first: lm-eval only imports it when empty)
except ImportError:  # lm-eval is an optional extra; the suite builder works without it
    HAVE_LM_EVAL = False
else:
    HAVE_LM_EVAL = True
    from .lm import CloverLM  # noqa: F401  (registers "clover")
