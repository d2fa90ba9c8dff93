"""``python -m sparkjax.bench <command>``: the benchmarks, one subcommand (module) each, every timing through
:mod:`sparkjax.bench.timing` (see ``docs/benchmarks.md``)."""
