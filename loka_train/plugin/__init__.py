"""loka_train.plugin: the LoKA callback, its config and presets, and the run report."""
