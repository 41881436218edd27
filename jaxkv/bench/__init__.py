"""Benchmarks and gates over jaxkv's library; the apps are `python3 -m jaxkv.bench` (__main__), `python3 -m
jaxkv.gates` and `python3 -m jaxkv.serve_bench`.

arms: arm names ("host_d2_int8", ...) and their configs. benchmark: the decode benchmark (arms x contexts x batches
in alternating rounds). ceilings: the link and transfer ceilings it measures beside the arms. peer_hf: the Hugging
Face offloaded-cache peer arm. report: its markdown report and plot. gate_suite: the exactness, memory and parallel
gates. serve_load: the server benchmark's load.

Importing this package or its library modules defines no flags: only the apps do, one app per process.
"""
