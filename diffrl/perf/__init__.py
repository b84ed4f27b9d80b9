"""Measuring what RL costs: FLOP counts, accelerator peaks (for MFU) and memory estimates.

Everything here works on the meta device too, so the full-size architectures
(``random:<arch>``, :mod:`diffrl.models.arch`) can be counted and sized on a CPU-only
machine; ``scripts/bench_rollout.py`` adds the wall-clock measurements.
"""
