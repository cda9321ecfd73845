"""Throughput of pagedllm against transformers (one at a time and static batches of 16).

    python benchmarks/throughput.py                       # both workloads, default model
    python benchmarks/throughput.py --workloads mixed --hf-solo-sample 4

Same as `pagedllm bench`; see engine/bench.py for the workloads and baselines.
"""

import sys

from pagedllm_integrations.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
