"""The model: layer implementations (llama, moe), weight-only int8 (quant), decode kernels (cpu_kernels),
loading (loader), sampling.

Torch-free at the package level, so a planner or CLI may read `COMPILE_MODES` without loading torch.
"""

# how a stage runs its one-token step: eager, or torch.compile'd (--compile, layerline_compile)
COMPILE_MODES = ("off", "default", "max-autotune")
