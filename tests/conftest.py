"""Eight simulated CPU devices for every test, set before JAX is imported anywhere, and one persistent compilation
cache for the apps that tests run."""

import os
import tempfile

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two XLA:CPU threads per device at least, as jaxkv.cli.setup_platform sets for the apps: with one per device a
# program's collective and the next program's launch can deadlock (seen as an all-reduce rendezvous timeout).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 16)))
# The apps that tests start in processes of their own share one persistent compilation cache (jaxkv.compile_cache
# reads this folder before the user's default one): a program that one of them compiled, the next loads. The test
# processes themselves do not write the cache: on jax 0.10.2 (CPU) a pytest worker once died with a segmentation fault
# inside the cache's write of an executable (jax/_src/compilation_cache.py, put_executable_and_time).
os.environ.setdefault("JAXKV_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxkv-tests-jax-cache"))
