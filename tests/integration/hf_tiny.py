"""A tiny LLaMA built by transformers for the TRL parity tests (DPO, GRPO): 2 layers, hidden 32, 4 heads
over 2 kv heads, fp32, eager attention, its weights spread from HF's near-flat init so the logits are
not uniform. Import it after ``pytest.importorskip("torch")``."""
import torch
import transformers


def tiny_llama(seed: int, vocab: int) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # HF's init gives near-flat logits; spread them
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "norm" in name else 0.2))
    return model
