"""Tiled online-softmax attention for JAX: FlashAttention-2 (Pallas Triton) and -3 (Mosaic GPU)."""
from pallas_attn.api import IMPLEMENTATIONS, default_order, flash_attention
from pallas_attn import reference

__all__ = ["IMPLEMENTATIONS", "default_order", "flash_attention", "reference"]
