"""`python3 -m jaxkv.serve`: the OpenAI-compatible server (jaxkv.apps.serve)."""

from jaxkv.apps import serve

if __name__ == "__main__":
  serve.run()
