"""pytest setup: none. The tests run as a user's plain `python3` process does, with no environment
variables set (the reference starts no BLAS threads; icl_fast holds BLAS at one thread itself)."""
