"""A Llama decoder in pure PyTorch, with safetensors weights and Hugging Face interchange.

    config = get_preset("demo", vocab_size=tokenizer_vocab)     # LlamaConfig, HF field names
    model = LlamaForPretraining(config)                         # normal(0, initializer_range) init
    model = load_pretrained("ckpt/")                            # config.json + model.safetensors, or:
    load_weights(model, "ckpt/model.safetensors")               # always into the PLAIN module, then:
    compiled = torch.compile(model)
    logits = compiled(input_ids)                                # (B, T, vocab), autocast dtype; no loss
    save_weights(compiled, "out/model.safetensors")             # unwrapped keys, tied head stored once
    export_hf(model, "hf_dir", tokenizer="tokenizer.json")      # LlamaForCausalLM.from_pretrained-able
    generate(model, ids, mask, max_new_tokens=64, temperature=0.8, top_k=50, eos_token_id=eos)

Nothing here imports Prefect, MLflow or the pipeline's tasks.
"""

from model.config import (
    MODEL_PRESETS,
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
from model.weights import load_pretrained, load_weights, save_weights, unwrap, weights_file

__all__ = [
    "MODEL_PRESETS",
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
    "load_pretrained",
    "load_weights",
    "save_weights",
    "unwrap",
    "weights_file",
]
