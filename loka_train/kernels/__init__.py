"""loka_train.kernels."""
