"""Benchmarks: ``specdec-bench`` (entry point ``specdec.infer.bench.cli:main``).

* ``specbench``: Spec-Bench's method (batch 1, greedy, chat template, multi-turn) on specdec's
  engine for any set of methods, with HF ``generate()`` and plain decoding as baselines;
* ``report``: results.json, results.md and speedup.png;
* ``serve_load`` (``specdec-bench --serve``): load test of an OpenAI-compatible server.
"""
