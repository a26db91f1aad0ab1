"""``python -m bench [ARGS]``: run the benchmarks (today: ``bench.cni_latency``)."""

from __future__ import annotations

import sys

from bench import cni_latency

if __name__ == "__main__":
    sys.exit(cni_latency.main(sys.argv[1:]))
