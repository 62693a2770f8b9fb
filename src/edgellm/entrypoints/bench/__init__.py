"""Benchmarks: `edgellm bench` (TTFT, prefill/decode tok/s, peak RSS, vs llama.cpp)."""
