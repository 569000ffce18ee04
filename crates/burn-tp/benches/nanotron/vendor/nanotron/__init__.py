# Shim (burn-tp): only nanotron's tensor-parallel functions are vendored here, unmodified; this
# package and `distributed.py` / `parallel/utils.py` stand in for the rest of nanotron.
