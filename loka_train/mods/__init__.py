"""loka_train.mods."""
