"""The f16x2 MXFP4 GEMVs, out of the product (see bench/experiments/README.md)."""
