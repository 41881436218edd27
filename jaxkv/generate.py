"""`python3 -m jaxkv.generate`: the generate app (jaxkv.apps.generate)."""

from jaxkv.apps import generate

if __name__ == "__main__":
  generate.run()
