"""4-bit (2..8-bit) weight quantization: formats, RTN / GPTQ / AWQ, checkpoints, Flax NNX.

Weights are in Flax orientation ``[K_in, N_out]``; groups run along K. See ``formats.py`` for the
packed layout and ``gptq.py`` / ``awq.py`` for the algorithms.

Example:
  >>> qw = quant.rtn(w, bits=4, group_size=128)
  >>> y = quant.int4_matmul(x, qw)                # == x @ quant.dequantize(qw)
"""
from quant.formats import (QuantizedWeight, dequantize, from_awq, from_gptq, pack, to_awq,
                           to_gptq, unpack)
from quant import calibration, hf
from quant.awq import AWQResult, awq
from quant.gptq import GPTQResult, gptq
from quant.matmul import int4_matmul
from quant.nnx import LayerReport, QuantLinear, quantize_model
from quant.rtn import rtn

__all__ = ["AWQResult", "GPTQResult", "LayerReport", "QuantLinear", "QuantizedWeight", "awq",
           "calibration", "dequantize", "hf", "from_awq", "from_gptq", "gptq", "int4_matmul", "pack",
           "quantize_model", "rtn", "to_awq", "to_gptq", "unpack"]
