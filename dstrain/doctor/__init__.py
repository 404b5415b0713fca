"""`dstrain doctor`: is this machine (or a pasted cluster's topology) set up for training?

Pure Python: parsers and checks import no `torch.distributed`; only `gpus.py` imports `torch`,
lazily, for versions and the GPU fallback, so the command starts fast."""
