"""`learner.activation_checkpointing` on a CUDA device: one rank wrapped in FSDP2 (`learner.fsdp: always`, NCCL),
fp32 and bf16, w3-125m (16 layers), a forward + backward of the policy on 8 and 32 rows of 1,024 random tokens, without
checkpointing, with it, and without it again (CUDA's own run-to-run gradient spread: some of its backward kernels
add in no fixed order): the largest gradient difference, the peak CUDA memory above what the state held before the pass,
and the median time of the last 3 of 4 passes.

    python benchmarks/activation_checkpointing_gpu.py     # ~45 s on an H100

Writes activation_checkpointing_gpu.json into $OUT (or /tmp); benchmarks/results/ holds the H100 run.
"""

import json
import os
import tempfile
import time
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from asyncrl.algo.sampling import RAW
from asyncrl.config import LearnerConfig
from asyncrl.learner.policy import shard
from asyncrl.learner.state import build_train_state
from asyncrl.models import build_model

torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
dev = torch.device("cuda")
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
with tempfile.TemporaryDirectory() as tmp:
    model_dir = str(build_model("w3-125m", Path(tmp) / "m", seed=0))
    for dtype in (torch.float32, torch.bfloat16):
        for rows, length in ((8, 1024), (32, 1024)):
            grads, case = {}, {"dtype": str(dtype), "rows": rows, "length": length}
            for ckpt in (False, True, 2):  # 2: the plain module again (CUDA's own run-to-run spread)
                torch.manual_seed(0)
                st = build_train_state(LearnerConfig(fsdp="always", activation_checkpointing=ckpt is True), model_dir, dev,
                                       lambda m: shard(m, mesh, dtype, "always"))
                g = torch.Generator().manual_seed(1)
                ids = torch.randint(3, 16, (rows, length), generator=g).to(dev)
                mask, pos = torch.ones_like(ids), torch.arange(length, device=dev).expand(rows, length)
                times = []
                for i in range(4):
                    st.policy.zero_grad(set_to_none=True)
                    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
                    t = time.perf_counter()
                    st.policy(ids, mask, pos, RAW).sum().backward()
                    torch.cuda.synchronize(); times.append(time.perf_counter() - t)
                    peak = torch.cuda.max_memory_allocated() - base
                name = {False: "plain", True: "ckpt", 2: "plain_again"}[ckpt]
                case[f"{name}_peak_over_base_bytes"] = peak
                case[f"{name}_s"] = sorted(times[1:])[1]
                grads[ckpt] = {n: p.grad.full_tensor().float().cpu() for n, p in st.policy.named_parameters()}
                del st; torch.cuda.empty_cache()
            case["max_grad_diff"] = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0])
            case["max_grad_diff_plain_again"] = max(float((grads[False][k] - grads[2][k]).abs().max()) for k in grads[0])
            case["max_grad"] = max(float(v.abs().max()) for v in grads[0].values())
            case["peak_ratio"] = case["ckpt_peak_over_base_bytes"] / case["plain_peak_over_base_bytes"]
            case["time_ratio"] = case["ckpt_s"] / case["plain_s"]
            print(json.dumps(case), flush=True)
            out["cases"].append(case)
dist.destroy_process_group()
Path(os.environ.get("OUT", "/tmp"), "activation_checkpointing_gpu.json").write_text(json.dumps(out, indent=1))
