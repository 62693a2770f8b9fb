"""The native model runner: a model's decode step (and a prompt's pieces) as one call through all of
its layers in C (kernels/llama_layer.c, gemma_layer.c). `structs` describes the weights to the C
layers (layer_types.h in ctypes), `caches` the KV caches, and `decoder` builds both from a model's
public parts and runs them."""
