"""The lab, apart from the runtime: the benchmark suite, model and host benchmarks, the shape
catalogs, autotune sweeps and the learned selector's training (``python -m patchgemm bench | tune``).
Nothing in the runtime package imports it; it imports the runtime like any user."""
