"""Where the time goes: the GPU kernels of one fwd+bwd of each case's implementations.

    python bench/profile_cases.py [filter] [impl]     (e.g. `P4 patchgemm`)

Prints, per case and implementation, the CUDA kernels sorted by total time (torch.profiler).
"""

import sys

import torch

from patchgemm.tools import bench


def main(argv):
    text = argv[1] if len(argv) > 1 else ""
    impl_filter = argv[2] if len(argv) > 2 else ""
    device = torch.device("cuda")
    for case in bench.suite(device):
        if text.lower() not in case.id.lower():
            continue
        inputs = case.make_inputs()
        for name, impl in case.impls.items():
            if impl_filter.lower() not in name.lower():
                continue
            out = impl(**inputs)
            dy = torch.randn_like(out)

            def step():
                y = impl(**inputs)
                torch.autograd.grad(y, [inputs[k] for k in case.grad_inputs], dy)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            print(f"== {case.id} / {name} (5 x fwd+bwd)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))


if __name__ == "__main__":
    main(sys.argv)
