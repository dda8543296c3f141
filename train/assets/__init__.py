"""Permissively licensed prompt data shipped with specdec (see README.md here).

Use `specdec.train.data.bundled_prompts(name)` for the paths; this file only makes the
folder a package so that its data files install with the wheel.
"""
