#!/usr/bin/env python3
"""Writes gpt3_1.3b_v100.json: a layer profile (docs/profile_format.md) computed from GPT-3
1.3B's dimensions for one 16 GB V100 per node (an AWS p3.2xlarge, the machine of the P3 spot
trace), not measured. Per block of hidden size h = 2048 on a microbatch of one 1024-token
sequence:
  parameters 12 h^2 (fp16, 2 bytes each); optimizer and gradient 14 bytes per parameter
  (fp32 master, Adam's two moments, the fp16 gradient);
  forward FLOPs 2 * 12 h^2 * s + 4 * s^2 * h at 60 TFLOP/s, backward twice that;
  activations kept for backward s * h * (34 + 5 * a * s / h) bytes (Megatron-LM's count,
  a = 16 heads), output s * h * 2 bytes.
The token embedding and the head (vocabulary 50257) are separate layers (not tied)."""
import json, sys

h, s, a, vocab = 2048, 1024, 16, 50257
flops_per_s = 60e12
block_params = 12 * h * h
block_fwd = 2 * block_params * s + 4 * s * s * h
layers = [{"name": "embed", "forward_ms": 0.1, "backward_ms": 0.2,
           "param_bytes": 2 * vocab * h, "optimizer_bytes": 14 * vocab * h,
           "activation_bytes": 2 * s * h, "output_bytes": 2 * s * h}]
for i in range(24):
    layers.append({"name": "block%d" % i,
                   "forward_ms": round(block_fwd / flops_per_s * 1e3, 4),
                   "backward_ms": round(2 * block_fwd / flops_per_s * 1e3, 4),
                   "param_bytes": 2 * block_params, "optimizer_bytes": 14 * block_params,
                   "activation_bytes": int(s * h * (34 + 5 * a * s / h)),
                   "output_bytes": 2 * s * h})
head_fwd = 2 * vocab * h * s
layers.append({"name": "head", "forward_ms": round(head_fwd / flops_per_s * 1e3, 4),
               "backward_ms": round(2 * head_fwd / flops_per_s * 1e3, 4),
               "param_bytes": 2 * vocab * h, "optimizer_bytes": 14 * vocab * h,
               "activation_bytes": 4 * s * vocab, "output_bytes": 4 * s * vocab})
profile = {"version": 1, "microbatch_size": 1,
           "job": {"devices_per_node": 1, "device_memory_bytes": 16 * 10**9,
                   "inter_stage_gbps": 10.0,
                   "allreduce": {"algorithm": "ring", "bandwidth_gbps": 10.0, "latency_us": 50.0}},
           "layers": layers}
out = sys.argv[1] if len(sys.argv) > 1 else "gpt3_1.3b_v100.json"
with open(out, "w") as f:
    json.dump(profile, f, indent=1)
    f.write("\n")
