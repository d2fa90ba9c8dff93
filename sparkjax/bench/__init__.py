"""``python -m sparkjax.bench <command>``: the benchmarks, one subcommand each (see ``docs/benchmarks.md``).

Subcommands: ar, round, tree, drafter, scale, train, attention (one module each); every timing goes through
:mod:`sparkjax.bench.timing`.
"""
