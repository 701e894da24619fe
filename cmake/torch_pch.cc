// Translation unit that owns the precompiled <torch/torch.h> (cmake/LoomTorch.cmake).
