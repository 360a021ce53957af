"""A tiny local Llama folder (config, safetensors, byte-level tokenizer) whose layer 1 overflows in float16.

Layer 1's MLP projections are scaled by 300 (weights stay below ~25) so its down-projection's output reaches
~5e5: inf in float16 (max 65504), an ordinary number in float32 (the next RMSNorm brings it back to scale). The config's dtype is float16, so `--dtype auto` runs it
in float16, as a real checkpoint whose config says float16.
"""
from __future__ import annotations

from pathlib import Path

OVERFLOW_LAYER = 1


def make_overflow_model(root: Path, config_dtype: str = "float16") -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(root)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                      bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(model.model.layers[OVERFLOW_LAYER].mlp, proj).weight.mul_(300.0)
    model.to(getattr(torch, config_dtype)).save_pretrained(root)  # the config records the weights' dtype
    return root
