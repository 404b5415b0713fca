"""`dstrain bench`: what the collectives and the matmuls of this machine or cluster really get.

Torch-free at import (the CLI builds its parser from `spec` and `sizes`); the measuring modules
(`ops`, `timing`, `comm`, `gemm`) import torch and run on every rank under torchrun.
"""
