"""The single-device DeepSeek-style model. Nothing here imports torch.distributed: `parallel/`
applies TP, EP, FSDP and PP to these modules afterwards. Importing the package itself is free
(no torch), so `flops.py` serves the planner on a laptop."""
