"""Named benchmarks: ``python -m benchmarks [NAME ...]`` times them and rewrites ``benchmarks/results.md``.

Targets are stated as ratios or rates measured within one run, never as timed assertions in tests.
"""
