"""Worker entry point: `torchrun --nproc-per-node N -m dstrain.bench comm [flags]`.

The same flags as `dstrain bench comm`; `dstrain bench comm --nproc N` launches exactly this
through torchrun's elastic agent. Leaves through `shutdown` (no gloo exit-time abort).
"""

import sys

from dstrain.cli.bench import main
from dstrain.parallel.distributed import shutdown

if __name__ == "__main__":
    shutdown(main(sys.argv[1:]))
