"""The KVarN method in PyTorch: reference quantizer (the byte-layout oracle), rival codecs, HF cache, fidelity."""
from .hadamard import hadamard
from .reference import dequantize_tiles, pack_records, quantize_tiles, reference_attention, unpack_records

__all__ = ["hadamard", "quantize_tiles", "unpack_records", "pack_records", "dequantize_tiles", "reference_attention"]
