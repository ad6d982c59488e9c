"""FlashAttention-2 on the Pallas Triton backend (any CUDA GPU sm80+; interpret mode on CPU)."""
from pallas_attn.triton.config import Config, default_config
from pallas_attn.triton.ops import attention

__all__ = ["Config", "attention", "default_config"]
