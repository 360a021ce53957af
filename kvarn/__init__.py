"""kvarn: KVarN KV-cache quantization for stock vLLM, and a suite to benchmark and evaluate KV-cache formats.

vLLM is never imported at package import time: the library and the CLI work where vLLM is absent.
"""
__version__ = "0.1.0"
