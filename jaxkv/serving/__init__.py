"""Serving: requests on the slots of an engine (`Server`), fed as they arrive (`ServingLoop`), over HTTP (`api`,
`metrics`; the `serve` extra), with a prefix cache (`prefix_cache`) and saved slots (`slot_files`).

Modules: `requests` (what is asked and answered), `scheduler` (the slot schedule, plain Python), `slots` (a request
prefilled alone and put into its slot), `server` (`Server`, a `Run` and its epochs over the decode loop), `loop`
(the engine thread, iterating over a run's epochs), `prefix_cache`, `slot_files`, `api`, `metrics`.
"""

from jaxkv.serving.loop import Closed, Handle, QueueFull, ServingLoop
from jaxkv.serving.requests import TOTALS, Request, RequestResult, ServeResult
from jaxkv.serving.server import Progress, Run, Server
from jaxkv.serving.slots import check_prefix_cache_budget

__all__ = [
    "Closed",
    "Handle",
    "QueueFull",
    "ServingLoop",
    "TOTALS",
    "Request",
    "RequestResult",
    "ServeResult",
    "Progress",
    "Run",
    "Server",
    "check_prefix_cache_budget",
]
