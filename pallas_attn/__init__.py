"""Tiled online-softmax attention for JAX: FlashAttention-2 (Pallas Triton) and -3 (Mosaic GPU)."""
from pallas_attn.api import IMPLEMENTATIONS, default_order, flash_attention
from pallas_attn import reference
from pallas_attn.fp8 import flash_attention_fp8, flash_attention_fp8_kv, quantize_kv

__all__ = ["IMPLEMENTATIONS", "default_order", "flash_attention", "flash_attention_fp8",
           "flash_attention_fp8_kv", "quantize_kv", "reference"]
