"""`python3 -m jaxkv.serve_bench`: the server benchmark (jaxkv.apps.serve_bench)."""

from jaxkv.apps import serve_bench

if __name__ == "__main__":
  serve_bench.run()
