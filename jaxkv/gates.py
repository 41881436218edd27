"""`python3 -m jaxkv.gates`: the exactness, memory and parallel gates (jaxkv.apps.gates)."""

from jaxkv.apps import gates

if __name__ == "__main__":
  gates.run()
