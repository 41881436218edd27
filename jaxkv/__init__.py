"""jaxkv: decode transformers in JAX with the KV cache in pinned host memory, delivered behind compute."""

from jaxkv.checkpoint import load as load_checkpoint
from jaxkv.config import Config, EngineConfig, KVConfig, ModelConfig, RopeScaling, SamplingConfig
from jaxkv.config import from_config_dict
from jaxkv.engine import Engine, GenerateResult
from jaxkv.gguf_loader import load as load_gguf
from jaxkv.mesh import make_mesh, sharding
from jaxkv.model import init_params
from jaxkv.run import build, build_from_checkpoint
from jaxkv.serving import Request, RequestResult, ServeResult, Server, ServingLoop
from jaxkv.tokenizer import Tokenizer

__all__ = [
    "Config",
    "EngineConfig",
    "KVConfig",
    "ModelConfig",
    "RopeScaling",
    "SamplingConfig",
    "from_config_dict",
    "Engine",
    "GenerateResult",
    "make_mesh",
    "sharding",
    "init_params",
    "build",
    "build_from_checkpoint",
    "load_checkpoint",
    "load_gguf",
    "Tokenizer",
    "Request",
    "RequestResult",
    "ServeResult",
    "Server",
    "ServingLoop",
]
