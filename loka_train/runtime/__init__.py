"""loka_train.runtime."""
