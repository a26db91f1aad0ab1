"""Cilia benchmarks (``make bench`` → ``python -m bench``). Not part of ``make test``.

Every benchmark compares Cilia with a baseline measured in the same run and reports the
ratio, prints a table and writes JSON under ``bench/results/``.
"""
