"""Worker entry point: `torchrun --nproc-per-node N -m dstrain.train [CONFIG] [--set k=v ...]`.

The same arguments as `dstrain train`; `dstrain train --nproc N` launches exactly this through
torchrun's elastic agent. Leaves through `shutdown` (no gloo exit-time abort).
"""

import sys

from dstrain.cli import main
from dstrain.parallel.distributed import shutdown

if __name__ == "__main__":
    shutdown(main(["train", *sys.argv[1:]]))
