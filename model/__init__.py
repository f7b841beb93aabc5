"""A Llama decoder in pure PyTorch, with safetensors weights and Hugging Face interchange."""

from model.config import (
    PRESETS,
    LlamaConfig,
    count_params,
    describe_presets,
    flops_per_token,
    get_preset,
)
from model.generate import generate, sample_next
from model.hf import export_hf, import_hf
from model.kv_cache import KVCache
from model.llama import LlamaForPretraining
from model.weights import load_weights, save_weights, unwrap

__all__ = [
    "PRESETS",
    "KVCache",
    "LlamaConfig",
    "LlamaForPretraining",
    "count_params",
    "describe_presets",
    "export_hf",
    "generate",
    "import_hf",
    "sample_next",
    "flops_per_token",
    "get_preset",
    "load_weights",
    "save_weights",
    "unwrap",
]
