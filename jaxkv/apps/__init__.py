"""The apps (python3 -m jaxkv.generate, jaxkv.serve, jaxkv.gates, jaxkv.serve_bench; jaxkv.bench is its own package):
flags, one-line errors and reports over the library. The library never imports them."""
