"""One CUDA W4 product at a given entry, launched four times, for Nsight Compute to read the last.
  GPU: ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
           --section SchedulerStats -k regex:w4_ --launch-skip 3 --launch-count 1 \
           python scripts/ncu_probe.py K N M TILES ROW_TILES SPLIT
  or, for what its warps wait on: ncu --metrics smsp__average_warps_issue_stalled_REASON_per_issue_active.ratio,...
           (REASON: wait, long_scoreboard, math_pipe_throttle, barrier, short_scoreboard, ...) with the same -k and
           launch options (docs/bench/cuda-w4-stalls-h100.txt has the full command)
K x N a synthetic fp16 W4 weight of 128-channel groups, M rows of activations; TILES, ROW_TILES and
SPLIT as cuda_w4.matmul takes them (the entry and K slices; docs/kernels.md, "What limits it")."""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from hierviz.quant import cuda_w4  # noqa: E402
from hierviz.quant.w4_proof import synthetic_weight  # noqa: E402


def main() -> None:
    if len(sys.argv) != 7:
        sys.exit(__doc__)
    k, n, m, tiles, row_tiles, split = (int(v) for v in sys.argv[1:7])
    w = synthetic_weight(n, k, 128, torch.device("cuda"), 1000, False, torch.float16)
    x = torch.randn(m, k, device="cuda").half()
    for _ in range(4):
        y = cuda_w4.matmul(x, w, tiles=tiles, row_tiles=row_tiles, split=split)
    torch.cuda.synchronize()
    print(f"{m}x{k} @ {n}x{k}: {tuple(y.shape)}")


if __name__ == "__main__":
    main()
