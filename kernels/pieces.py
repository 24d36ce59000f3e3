"""The piece size of the kernels' chunked passes: one number for every kernel that walks a tensor a piece at a time
(exact selection, the sign consensus, SCE's erase, the masks' draws)."""

from __future__ import annotations

# Elements per piece (512 KB of float32: a piece of each of a few inputs stays in a 2 MiB L2 cache).
# WHY not smaller: every op on a piece is a Python call that takes and hands back the GIL, and the executor merges
# tensors on two or more threads at once, so small pieces cost GIL handoffs more than arithmetic. Pieces of 32,000
# (chosen to stay under torch's intra-op grain of 32,768) made TIES over 4 x 1.35 GB models 12.3 s of wall and 4.3
# system CPU s (futex handoffs); 128,000: 10.5 and 3.1 s (medians of 3, 2-vCPU VM; 256,000: 10.8 s, 512,000: 11.2 s).
# Above the grain, an op is split over torch's intra-op threads when a merge thread has more than one (``alloy merge
# --threads``, ``merge.threads``; the default is one). The pieces change no bit: every chunked pass is elementwise
# or counts integers.
PIECE = 128_000
