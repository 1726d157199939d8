"""cuDNN-frontend's DSA backward at the long-context shapes, timed at two duty cycles:

    PYTHONPATH=$W:$W/nvidia_cutlass_dsl/dsl_packages python3 dev/peer_bwd_duty.py \\
        PEER_SCRIPT [filters, e.g. 'v32,v4pro S=65536'] [seconds]

PEER_SCRIPT is the team's peer benchmark (bench_cudnn_bwd.py: its SHAPES, inputs, reference and
wrapper are reused, so the lists are the same). Per shape: "burst" = 10 calls after 3 s idle,
"sustained" = back-to-back calls for about `seconds` (default 3) after the burst, each between
CUDA events. At the H200's 700 W cap the sustained clock settles near 1.75-1.8 GHz against
~1.98 GHz in a burst, so the two differ by up to ~10 % on these kernels; compare like with like
(examples/benchmark.py --batches 3 --batch-ms 3000 is ours sustained).
"""
import importlib.util
import sys
import time

import torch


def main():
    spec = importlib.util.spec_from_file_location("peer", sys.argv[1])
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    only = sys.argv[2] if len(sys.argv) > 2 else ""
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, D, H, K, T, S in peer.SHAPES:
        if only and not any(f in f"{label} S={S}" for f in only.split(",")):
            continue
        q, kv, idx, sink, dout = peer.inputs(D, H, K, T, S, g)
        scale = D ** -0.5
        out, lse = peer.reference(q, kv, idx, sink, scale)

        def call():
            return peer.sparse_attention_backward_wrapper(q, kv, out, dout, lse, sink, idx,
                                                          softmax_scale=scale)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        call()
        e1.record()
        e1.synchronize()
        n_sus = max(10, int(seconds * 1e3 / e0.elapsed_time(e1)))
        res = []
        for name, n, idle in (("burst", 10, 3.0), ("sustained", n_sus, 0.0)):
            time.sleep(idle)
            e0.record()
            for _ in range(n):
                call()
            e1.record()
            e1.synchronize()
            res.append(f"{name} {e0.elapsed_time(e1) / n * 1e3:.1f} us ({n} calls)")
        print(f"RESULT cudnn bwd {label} S={S} D={D} H={H} K={K}: " + ", ".join(res), flush=True)
        del q, kv, idx, sink, dout, out, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
