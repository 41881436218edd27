"""Eight simulated CPU devices for every test; set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two XLA:CPU threads per device at least, as jaxkv.cli.setup_platform sets for the apps: with one per device a
# program's collective and the next program's launch can deadlock (seen as an all-reduce rendezvous timeout).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 16)))
