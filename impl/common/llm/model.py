"""Tiny Llama built from a ``transformers.LlamaConfig`` (random weights, fixed seed) and an
in-memory byte-level tokenizer: nothing is downloaded.

The serving engine runs its own ragged forward (:func:`forward_batch`) over the HF modules so
that requests of different lengths share one flattened token batch with per-request KV caches
(vLLM-style continuous batching); :func:`hf_logits` is the stock HF forward used as the oracle.
"""
from __future__ import annotations

from typing import Optional

import torch

from impl.common.api import ConfigError
from impl.common.workloads.pipeline import ModelShape

SITES = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_llama_shape(shape: ModelShape) -> None:
    """What :func:`llama_config` needs of a shape (a system's preflight calls it too)."""
    if shape.ffn_hidden < 1:
        raise ConfigError(f"model.ffn_hidden: a Llama needs its SwiGLU width (> 0), got {shape.ffn_hidden}")
    if shape.hidden % shape.heads:
        raise ConfigError(f"model.hidden {shape.hidden} is not divisible by model.heads {shape.heads}")
    if shape.heads % shape.num_kv_heads:
        raise ConfigError(f"model.heads {shape.heads} is not divisible by model.kv_heads {shape.num_kv_heads}")
    if shape.vocab < 260:
        raise ConfigError(f"model.vocab must be >= 260 for the byte tokenizer, got {shape.vocab}")


def llama_config(shape: ModelShape):
    """The ``transformers.LlamaConfig`` of a LLaMA shape (``ffn_hidden`` = intermediate_size,
    ``seq_len`` = max_position_embeddings)."""
    from transformers import LlamaConfig

    check_llama_shape(shape)
    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn_hidden,
                       num_hidden_layers=shape.num_layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.num_kv_heads, vocab_size=shape.vocab,
                       max_position_embeddings=shape.seq_len, tie_word_embeddings=False,
                       attn_implementation="eager", bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_llama(shape: ModelShape, seed: int = 0, device=None, dtype: Optional[torch.dtype] = None):
    """``LlamaForCausalLM`` with seeded random weights, in eval mode: fp32 on the CPU by default.

    ``device``: build it there (a 7B-shaped model is initialised on the GPU in seconds; on the
    CPU it takes minutes and 26 GB); the weights then come from that device's generator, so they
    differ from a CPU build of the same seed. ``dtype``: cast after the fp32 build."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(shape)
    dev = torch.device(device) if device is not None else None
    fork = {} if dev is None else {"devices": [dev.index or 0] if dev.type == "cuda" else []}
    with torch.random.fork_rng(**fork):
        torch.manual_seed(seed)
        if dev is None:
            model = LlamaForCausalLM(cfg)
        else:
            with dev:
                model = LlamaForCausalLM(cfg)
    return model.to(dtype or torch.float32).eval()


def build_tokenizer():
    """Byte-level BPE tokenizer with no merges, held in memory: ids 0..3 specials, 4..259 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = pre_tokenizers.ByteLevel.alphabet()
    from tokenizers.pre_tokenizers import ByteLevel

    # GPT-2 byte -> unicode table, in byte order, so id = 4 + byte value.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_char = dict(zip(bs, (chr(c) for c in cs)))
    assert set(byte_char.values()) == set(chars)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for b in range(256):
        vocab[byte_char[b]] = 4 + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def encode_bytes(text: str) -> list[int]:
    """Byte ids for ``text`` (the tokenizer's vocabulary, without going through HF)."""
    return [4 + b for b in text.encode("utf-8")]


def synthetic_prompt(length: int, rng) -> list[int]:
    """A deterministic prompt of ``length`` byte tokens (printable ASCII)."""
    return [4 + int(b) for b in rng.integers(32, 127, size=length)]


@torch.no_grad()
def hf_logits(model, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Stock HF forward (the oracle): logits [B, T, V]."""
    return model(input_ids=input_ids, use_cache=False, **kwargs).logits
