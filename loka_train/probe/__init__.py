"""loka_train.probe."""
