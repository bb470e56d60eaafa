"""The neural-network pieces: masks, positions, attention and its kernels, the layers and
blocks, mixture of experts, LoRA, quantization and the losses. Pure JAX math, and Linen
modules where there are params."""
