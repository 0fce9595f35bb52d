"""Benchmarks and evaluation harnesses, one module each; `clover bench NAME` (clover/cli/bench.py) only
defines their flags and calls `run(args)`, which measures, prints a markdown table and writes JSON.

* `decode` - tokens/s and tokens per forward of each decoding mode vs transformers' generate.
* `decide` - joint vs independent decision mode on the decision benchmark's held-out split.
* `pareto` - the speed-quality curve (the suite evaluation itself is clover.eval.pareto).
* `agent` - the local tool-use benchmark: seeded toolbox cases, AST call matching, real episodes.
* `structured` - structured output: the seeded infill / grammar / free comparison (cases, methods,
  scoring) and the schema corpus's coverage report.
* `report` - what they share: markdown tables, `--json` output, progress bars, torch threads.

Scripts in bench/ (forward, train, quant, distributed, llamacpp, serve, step) time things outside
the CLI and write their sections of BENCHMARKS.md through bench/update.py.
"""
