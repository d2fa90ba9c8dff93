"""``python -m sparkjax.bench <command>``: the benchmarks, one subcommand each (see ``docs/benchmarks.md``).

``ar`` (greedy decoding against transformers), ``round`` (kernel / byte / FLOP counts of a round from the compiled
HLO: a GPU projection), ``tree`` (on-device tree builders against the NumPy references), ``drafter`` (one drafting
step against PyTorch), ``scale`` (real-size rounds with forced acceptance, measured; ``--memory``: compiled memory),
``train`` (training throughput and a Qwen3-4B-shaped step's memory) and ``attention`` (batched decode attention
against torch's SDPA). Every timing goes through :mod:`sparkjax.bench.timing`.
"""
