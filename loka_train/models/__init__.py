"""loka_train.models."""
