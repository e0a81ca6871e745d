"""loka_train.comm."""
