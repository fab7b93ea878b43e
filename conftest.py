"""pytest setup: none. The library handles BLAS threads itself (icl_ref.one_blas_thread), so the
tests run as a user's plain `python3` process does, with no environment variables set."""
