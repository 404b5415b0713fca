"""Worker entry point: `torchrun --nproc-per-node N -m dstrain.train [CONFIG] [--set k=v ...]`.

The run flags of `dstrain train` (CONFIG, --set, --resume, --fresh, --profile-steps, --json);
`dstrain train --nproc N` launches exactly this through torchrun's elastic agent. Leaves
through `shutdown` (no gloo exit-time abort).
"""

import sys

from dstrain.parallel.distributed import shutdown
from dstrain.train.worker import main

if __name__ == "__main__":
    shutdown(main(sys.argv[1:]))
