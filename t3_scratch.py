import sys; sys.path.insert(0, "tests")
import conftest, dataclasses, helpers
from jaxkv import serving, engine as engine_lib
import numpy as np
cfg = helpers.tiny_config()
def eng(impl, placement="device"):
  c = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, decode_attention=impl))
  c = dataclasses.replace(c, kv=dataclasses.replace(c.kv, placement=placement, pipeline_depth=1))
  return engine_lib.Engine(c, helpers.mesh(1), helpers.params(1))
rng = np.random.default_rng(5)
x = serving.Request(tuple(rng.integers(2, 250, 20).tolist()), 12, seed=0)
others = [serving.Request(tuple(rng.integers(2, 250, n).tolist()), 12, seed=i + 1) for i, n in enumerate((60, 50, 70))]
for impl in ("xla", "legacy"):
  e = eng(impl)
  for pc in (1, 0):
    alone = serving.Server(e, 1, prefix_cache_bytes=pc).serve([x]).results[0]
    among = serving.Server(e, 4, prefix_cache_bytes=pc).serve(others[:2] + [x] + others[2:]).results[2]
    print(impl, "prefix cache" if pc else "no cache", alone.tokens == among.tokens, alone.logits_sha256 == among.logits_sha256, among.first_row)
