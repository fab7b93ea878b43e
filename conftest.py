"""pytest setup: one OpenBLAS thread, set before NumPy and SciPy load.

icl_ref's hot path is single-threaded batched small matmuls; SciPy's L-BFGS-B wakes the BLAS
thread pool every iteration and its spinning workers take the second core from it, which makes
training about 2x slower on 2 cores (measured). Tests and experiments therefore pin one thread.
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
