"""`python -m patchgemm bench | info | kernels | tune`."""

import argparse
import sys

import torch


def info() -> int:
    import patchgemm

    flavour, archs, blas = torch.ops.patchgemm.build_info()
    print(f"patchgemm {patchgemm.__version__}")
    print(f"build flavour: {flavour}" + (f" (arch list: {archs})" if archs else ""))
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, HIP {torch.version.hip}")
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()} (compute capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability()))})")
        if flavour != "cpu":
            print(f"BLAS: {blas}")
    else:
        print("GPU: none visible")
    return 0


def list_kernels(op=None) -> int:
    from .selection import kernels

    try:
        rows = kernels(op)
    except ValueError as e:  # an unknown op: say which exist, no traceback
        print(e, file=sys.stderr)
        return 2
    current = None
    for c in rows:
        if c.op != current:
            print(f"{c.op}:")
            current = c.op
        print(f"  {c.name:<22} [{c.backends}]  {c.conditions}")
    return 0


def _device(text: str) -> str:
    """--device: cpu, or cuda[:N] where this torch has a GPU (argparse reports anything else)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the benchmarks run on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch ({torch.__version__}) sees no CUDA device")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patchgemm")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run the benchmark suite (ours vs PyTorch baselines vs the floor)")
    bench.add_argument("--device", type=_device, help="cuda or cpu (default: cuda if present)")
    bench.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    bench.add_argument("--filter", help="run only these cases, comma-separated: a case id (\"G1 fp32\") or "
                       "its first word for the family (\"G1\")")
    bench.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 cases (default: torch's setting)")
    bench.add_argument("--plot", metavar="PATH", help="also draw the results (speedup over PyTorch, %% of floor); "
                       "needs matplotlib")
    bench.add_argument("--from-json", metavar="PATH", help="do not run: print (and --plot) a saved --json file")
    bench.add_argument("--models", nargs="?", const="all", metavar="NAMES",
                       help="instead of the suite: a training step of real models, original vs converted "
                       "(comma-separated names, default all: ViT-B/16, ViT-L/14, ConvNeXt-T, ConvNeXt-CL, Swin-T, "
                       "VideoMAE-S, MATEY-3D, Mixtral-S, Mixtral-S-bf16, OLMoE-S, OLMoE-S-bf16, Qwen3-MoE-S)")
    bench.add_argument("--compile", action="store_true",
                       help="with --models: each model compiled (torch.compile of the original, of convert()'s "
                       "model, and patchgemm.compile), each without and with CUDA graphs")
    bench.add_argument("--host", action="store_true",
                       help="instead of the suite: the host time per call of every op vs the PyTorch op it replaces")
    sub.add_parser("info", help="version, build flavour, torch/CUDA/BLAS versions")
    kernels = sub.add_parser("kernels", help="every op's implementations, in the order the default choice tries them")
    kernels.add_argument("op", nargs="?", help="only this op's")
    tune = sub.add_parser("tune", help="autotune shape sets, train the learned selector, report regret per mode")
    tune.add_argument("--train-on", default="tuning,random,models,families", help="sets whose records train the "
                      "model (tuning, random, models, families, heldout; default tuning,random,models,families)")
    tune.add_argument("--evaluate-on", default="heldout", help="sets whose records judge it (default heldout)")
    tune.add_argument("--random", type=int, default=200, help="shapes in the random set (default 200)")
    tune.add_argument("--random-start", type=int, default=0, metavar="K", help="sweep only shapes K .. N - 1 of "
                      "the random and models sets' sequences (to extend a saved sweep; merge the --json files)")
    tune.add_argument("--model-like", type=int, default=200, metavar="N", help="shapes in the models set: layer "
                      "kinds of real models drawn at random (default 200)")
    tune.add_argument("--seed", type=int, default=0, help="the random and models sets' seed")
    tune.add_argument("--only-channels-last", action="store_true", help="sweep only the sets' channels-last "
                      "shapes (to re-measure them once the channels-last paths change; merge with --from-json "
                      "NEW,OLD, whose first file's records win)")
    tune.add_argument("--cache-dir", help="autotune's directory (default ~/.cache/patchgemm or $PATCHGEMM_CACHE_DIR)")
    tune.add_argument("--model", metavar="PATH", help="write the trained model here")
    tune.add_argument("--json", metavar="PATH", help="write the records and the report (gzip-compressed where "
                      "PATH ends in .gz, as --from-json reads it)")
    tune.add_argument("--from-json", metavar="PATHS", help="do not sweep: train and judge on saved --json files "
                      "(comma-separated)")
    tune.add_argument("--relabel", action="store_true", help="with --from-json: replace the records' heuristic "
                      "choices with today's (runs each shape once, untimed; the GPU should be the records')")
    tune.add_argument("--records-only", action="store_true", help="write the records (swept, or read and "
                      "relabeled) to --json and train nothing")
    tune.add_argument("--cross-validate", type=int, metavar="K", help="instead of training one "
                      "model, judge each training record by a model of the other K - 1 folds of shapes")
    tune.add_argument("--validate", type=int, default=0, metavar="K", help="keep in the trained model only the "
                      "ops whose choices beat the heuristic's in K-fold cross-validation (the others choose by "
                      "the heuristic)")
    tune.add_argument("--margin", type=float, default=0.0, metavar="M", help="lean the trained model toward "
                      "PyTorch's own paths by M (the aten_* candidates' scores raised by M; default 0)")
    tune.add_argument("--unsure-gap", type=float, default=0.0, metavar="G", help="the trained model's unsure gap: "
                      "the learned mode times the candidates scored within G of the best (default 0: never)")
    tune.add_argument("--hold-out-families", metavar="NAMES", help="instead of training one model, judge each "
                      "model family (comma-separated, or 'all': every family of the records) by a model trained "
                      "on the others' records; families in patchgemm/tools/shapes.py")
    tune.add_argument("--margins", default="0", metavar="M,...", help="with --hold-out-families: the margins "
                      "toward PyTorch's paths to judge the learned mode at (default 0)")
    tune.add_argument("--unsure-gaps", default="0", metavar="G,...", help="with --hold-out-families: judge "
                      "the learned mode also timing the candidates scored within G of the best (default 0: never)")
    tune.add_argument("--train-device", metavar="TEXT", help="train only on records of GPUs whose name has TEXT")
    tune.add_argument("--evaluate-device", metavar="TEXT", help="judge only on records of GPUs whose name has TEXT")
    tune.add_argument("--device", type=_device, help="cuda or cpu (default: cuda if present)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "kernels":
        return list_kernels(args.op)
    if args.command == "tune":
        from .tools import tune as tuning

        return tuning.main(args)
    from .tools import bench as suite

    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.from_json:
        return suite.replay(args.from_json, plot_path=args.plot)
    if args.host:
        from .tools import host_bench

        return host_bench.main(device=args.device, json_path=args.json)
    if args.models:
        from .tools import model_bench

        names = None if args.models == "all" else [n.strip() for n in args.models.split(",") if n.strip()]
        return model_bench.main(names, device=args.device, json_path=args.json, compiled=args.compile)
    return suite.main(device=args.device, json_path=args.json, filter=args.filter, plot_path=args.plot)


if __name__ == "__main__":
    sys.exit(main())
