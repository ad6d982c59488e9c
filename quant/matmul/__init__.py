"""W4A16 matmul ``x @ dequantize(qw)``: public entry point and backends."""
from quant.matmul.api import IMPLEMENTATIONS, int4_matmul

__all__ = ["IMPLEMENTATIONS", "int4_matmul"]
