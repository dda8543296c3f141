"""Spec-Bench's question set, shipped with specdec (see README.md and LICENSE here).

`specdec.infer.bench.specbench.DEFAULT_QUESTIONS` is the path; this file only makes the folder a
package so that its data files install with the wheel.
"""
