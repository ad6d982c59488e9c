"""FlashAttention-3 forward on the Pallas Mosaic GPU backend (Hopper sm90; interpret mode on CPU)."""
from pallas_attn.mosaic.config import Config, default_config
from pallas_attn.mosaic.ops import attention

__all__ = ["Config", "attention", "default_config"]
