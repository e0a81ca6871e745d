"""loka_train.data."""
