"""Studies: experiments that sit on top of the recipe, not inside it. Each one drives the public entry points (the
`da3po train` command, run directories, ``metrics.jsonl``) and nothing in the core package imports it.

- :mod:`~da3po_megatron.studies.compare`: the compute-matched {method} x {seed} algorithm comparison behind
  ``tools/compare_algorithms.py`` and ``docs/results_cpu.md``.
"""
